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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::error::Category;
use serde_json::value::RawValue;

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
///
/// Each file's text is kept and its documents are read one at a time, as raw text that is
/// canonicalized on its own (already canonical, as generated fixtures are, it is only
/// scanned): a whole file parsed as one `serde_json::Value` took 13 times its size (1.3 GB of
/// RSS for a 100 MB store).
pub fn load(path: &Path) -> Result<State, FixtureError> {
    let mut docs = Vec::new();
    if !path.is_dir() {
        let text = read_text(path)?;
        let namespaces = object_in(&text, path, || "the top level must be an object of namespaces".to_string())?;
        for (ns, raw) in namespaces {
            let records = object_in(raw.get(), path, || format!("namespace '{ns}' must be an object of documents"))?;
            add_documents(&mut docs, &ns, records, path, |key, what| {
                format!(
                    "'{ns}/{key}' is {what}, not a document: a fixture file holds {{namespace: {{key: document}}}}, \
                     every document a JSON object. This file looks like the records of one namespace \
                     ({{key: record}}, like tau-bench's flights.json): put it in a directory as \
                     <namespace>.json and give the directory"
                )
            })?;
        }
        return Ok(State::from_versioned(docs, [], 1));
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
    for file in files {
        let ns = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        let text = read_text(&file)?;
        let records = object_in(&text, &file, || format!("namespace '{ns}' must be an object of documents"))?;
        add_documents(&mut docs, &ns, records, &file, |key, what| {
            format!(
                "'{key}' is {what}, not a document: a <namespace>.json file of a fixture directory \
                 holds {{key: document}}, every document a JSON object"
            )
        })?;
    }
    Ok(State::from_versioned(docs, [], 1))
}

/// A JSON object's members as raw text, in key order (a key given twice: its last value).
type RawMembers<'a> = BTreeMap<String, &'a RawValue>;

/// The members of the object `text` holds; `not_an_object` says why anything else is refused.
fn object_in<'a>(
    text: &'a str,
    path: &Path,
    not_an_object: impl FnOnce() -> String,
) -> Result<RawMembers<'a>, FixtureError> {
    serde_json::from_str(text).map_err(|error| match error.classify() {
        Category::Data => shape(path, not_an_object()),
        _ => FixtureError::Json { path: path.to_path_buf(), error },
    })
}

/// Adds the documents of namespace `ns` (read from `path`) in their canonical form. The
/// first one that is not a JSON object is refused with `not_a_record(its key, what it is)`.
fn add_documents(
    docs: &mut Vec<(String, String, String, u64)>,
    ns: &str,
    records: RawMembers<'_>,
    path: &Path,
    not_a_record: impl Fn(&str, &str) -> String,
) -> Result<(), FixtureError> {
    for (key, raw) in records {
        // A number the parser cannot hold (1e400) is refused here, naming the document.
        let text = crate::json::canonicalize(raw.get())
            .map_err(|error| shape(path, format!("document '{ns}/{key}': {error}")))?
            .into_owned();
        let what = match text.as_bytes().first() {
            Some(b'{') => {
                docs.push((ns.to_string(), key, text, 1));
                continue;
            }
            Some(b'n') => "null",
            Some(b't' | b'f') => "a boolean",
            Some(b'"') => "a string",
            Some(b'[') => "an array",
            _ => "a number",
        };
        return Err(shape(path, not_a_record(&key, what)));
    }
    Ok(())
}

fn shape(path: &Path, reason: String) -> FixtureError {
    FixtureError::Shape { path: path.to_path_buf(), reason }
}

fn read_text(path: &Path) -> Result<String, FixtureError> {
    std::fs::read_to_string(path).map_err(|error| FixtureError::Io { path: path.to_path_buf(), error })
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
        std::fs::write(&bad, r#"{"flights": {"HAT001": {"price": 1e400}}}"#).unwrap();
        let msg = load(&bad).unwrap_err().to_string();
        assert!(msg.contains("bad.json: document 'flights/HAT001': number out of range"), "{msg}");
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
