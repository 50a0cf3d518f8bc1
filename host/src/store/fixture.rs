//! Loading a store from fixture files.
//!
//! A fixture is either one JSON file holding `{namespace: {key: document}}`, or a directory
//! whose `<namespace>.json` files each hold `{key: document}` (the layout of tau-bench's
//! `flights.json`, `reservations.json`, `users.json`, which therefore load unchanged).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::State;

/// Why a fixture could not be loaded; always names the file.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error("cannot read fixture {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("fixture {path} is not valid JSON: {error}")]
    Json { path: PathBuf, error: serde_json::Error },
    #[error("fixture {path}: {reason}")]
    Shape { path: PathBuf, reason: String },
}

/// Loads the state a fixture file or directory describes.
pub fn load(path: &Path) -> Result<State, FixtureError> {
    let io = |error| FixtureError::Io { path: path.to_path_buf(), error };
    let value = if path.is_dir() {
        let mut namespaces = Map::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        for file in files {
            let ns = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
            namespaces.insert(ns, read_json(&file)?);
        }
        Value::Object(namespaces)
    } else {
        read_json(path)?
    };
    State::from_json(&value).map_err(|reason| FixtureError::Shape { path: path.to_path_buf(), reason })
}

fn read_json(path: &Path) -> Result<Value, FixtureError> {
    let text = std::fs::read_to_string(path).map_err(|error| FixtureError::Io { path: path.to_path_buf(), error })?;
    serde_json::from_str(&text).map_err(|error| FixtureError::Json { path: path.to_path_buf(), error })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_of_namespace_files_loads_like_one_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("flights.json"), r#"{"HAT001": {"origin": "SFO"}}"#).unwrap();
        std::fs::write(dir.path().join("users.json"), r#"{"u1": {"name": "Ada"}}"#).unwrap();
        let one = dir.path().join("all.json.txt");
        std::fs::write(&one, r#"{"users": {"u1": {"name": "Ada"}}, "flights": {"HAT001": {"origin": "SFO"}}}"#)
            .unwrap();
        assert_eq!(load(dir.path()).unwrap().digest(), load(&one).unwrap().digest());
    }

    #[test]
    fn errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{ nope").unwrap();
        let msg = load(&bad).unwrap_err().to_string();
        assert!(msg.contains("bad.json") && msg.contains("not valid JSON"), "{msg}");
        std::fs::write(&bad, "[1, 2]").unwrap();
        assert!(load(&bad).unwrap_err().to_string().contains("object of namespaces"));
        assert!(load(&dir.path().join("missing.json")).unwrap_err().to_string().contains("missing.json"));
    }
}
