//! Loading a store from fixture files.
//!
//! A fixture is either one JSON file holding `{namespace: {key: document}}`, or a directory
//! whose `<namespace>.json` files each hold `{key: document}` (the layout of tau-bench's
//! `flights.json`, `reservations.json`, `users.json`, which therefore load unchanged). A
//! directory with no `*.json` file in it is an error, not an empty store.
//!
//! Every document of a fixture is a JSON object (a record). That rule is also what tells the
//! one-file form from the records of one namespace (`{key: record}`, like tau-bench's
//! `flights.json` given on its own): read as `{namespace: {key: document}}`, such a file
//! would become namespaces named after its records, holding their fields — strings and
//! numbers — as documents. It is refused instead, with the way to load it (a directory).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::State;

/// Why a fixture could not be loaded; always names the file (or directory).
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error("cannot read fixture {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("fixture {path} is not valid JSON: {error}")]
    Json { path: PathBuf, error: serde_json::Error },
    #[error("fixture {path}: {reason}")]
    Shape { path: PathBuf, reason: String },
    #[error(
        "no *.json fixture files in {path}: a fixture directory holds one <namespace>.json file \
         ({{key: document}}) per namespace"
    )]
    NoFiles { path: PathBuf },
}

/// Loads the state a fixture file or directory describes.
pub fn load(path: &Path) -> Result<State, FixtureError> {
    let shape = |at: &Path, reason: String| FixtureError::Shape { path: at.to_path_buf(), reason };
    if !path.is_dir() {
        let value = read_json(path)?;
        let state = State::from_json(&value).map_err(|reason| shape(path, reason))?;
        for (ns, docs) in value.as_object().into_iter().flatten() {
            let Some((key, what)) = docs.as_object().and_then(not_a_record) else { continue };
            return Err(shape(
                path,
                format!(
                    "'{ns}/{key}' is {what}, not a document: a fixture file holds {{namespace: {{key: document}}}}, \
                     every document a JSON object. This file looks like the records of one namespace \
                     ({{key: record}}, like tau-bench's flights.json): put it in a directory as \
                     <namespace>.json and give the directory"
                ),
            ));
        }
        return Ok(state);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|error| FixtureError::Io { path: path.to_path_buf(), error })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    if files.is_empty() {
        return Err(FixtureError::NoFiles { path: path.to_path_buf() });
    }
    files.sort();
    let mut namespaces = Map::new();
    for file in files {
        let ns = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        let docs = read_json(&file)?;
        // A file that is not an object at all is `State::from_json`'s to refuse.
        if let Some((key, what)) = docs.as_object().and_then(not_a_record) {
            return Err(shape(
                &file,
                format!(
                    "'{key}' is {what}, not a document: a <namespace>.json file of a fixture directory \
                     holds {{key: document}}, every document a JSON object"
                ),
            ));
        }
        namespaces.insert(ns, docs);
    }
    State::from_json(&Value::Object(namespaces)).map_err(|reason| shape(path, reason))
}

/// The first document of a namespace that is not a JSON object, and what it is instead.
fn not_a_record(docs: &Map<String, Value>) -> Option<(&str, &'static str)> {
    let (key, doc) = docs.iter().find(|(_, doc)| !doc.is_object())?;
    let what = match doc {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    Some((key, what))
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

    #[test]
    fn a_directory_without_json_files_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README.txt"), "not a fixture").unwrap();
        let msg = load(dir.path()).unwrap_err().to_string();
        assert!(msg.contains(&format!("no *.json fixture files in {}", dir.path().display())), "{msg}");
    }

    #[test]
    fn a_file_of_records_is_not_taken_for_namespaces() {
        let dir = tempfile::tempdir().unwrap();
        let records = r#"{"HAT001": {"flight_number": "HAT001", "dates": {}}, "HAT002": {"flight_number": "HAT002"}}"#;
        let file = dir.path().join("flights.json");
        std::fs::write(&file, records).unwrap();
        let msg = load(&file).unwrap_err().to_string();
        assert!(msg.contains("flights.json: 'HAT001/flight_number' is a string, not a document"), "{msg}");
        assert!(msg.contains("{namespace: {key: document}}") && msg.contains("<namespace>.json"), "{msg}");

        // The same file in a directory is the namespace `flights`.
        let db = dir.path().join("db");
        std::fs::create_dir(&db).unwrap();
        std::fs::write(db.join("flights.json"), records).unwrap();
        let state = load(&db).unwrap();
        assert_eq!(state.namespace("flights").unwrap().len(), 2);

        // There too, a document is an object.
        std::fs::write(db.join("users.json"), r#"{"u1": {"name": "Ada"}, "count": 3}"#).unwrap();
        let msg = load(&db).unwrap_err().to_string();
        assert!(msg.contains("users.json: 'count' is a number, not a document"), "{msg}");
    }
}
