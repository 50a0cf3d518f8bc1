//! The event journal of a saga run: every event with run id, step, tool, attempt,
//! idempotency key, duration and replayed flag. Written as JSON Lines.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::runtime::{CallError, FailureKind};
use crate::sync::lock;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    SagaStarted,
    /// A run interrupted by a crash was picked up again.
    SagaResumed,
    StepStarted,
    StepCompleted,
    StepFailed,
    StepRetried,
    CompensationTriggered,
    CompensationStarted,
    CompensationCompleted,
    /// A compensator's undo committed but its reply was lost: the undo is taken as done (a
    /// resumed run runs it again, which finds nothing left to undo).
    CompensationUncertain,
    CompensationFailed,
    CompensationRetried,
    SagaFinished,
}

/// A failure as the journal and reports record it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// `rejected`, `out_of_fuel`, `binding`, `lost_response`, ...
    pub code: String,
    pub kind: FailureKind,
    pub message: String,
}

impl From<&CallError> for ErrorInfo {
    fn from(e: &CallError) -> Self {
        ErrorInfo { code: e.code().to_string(), kind: e.kind(), message: e.to_string() }
    }
}

/// One journal record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Position in the run's journal, from 0.
    pub seq: u64,
    pub run_id: String,
    pub event: EventKind,
    /// Microseconds since the run started (wall clock; left out of reproducible reports).
    pub at_us: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The step's compensator (step started events): a resumed session knows what undoes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
    /// Arguments (started events) or output (completed events). Shared: a step's arguments
    /// are one tree in its started events and in the run's progress, which compensation reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Arc<Value>>,
    /// The documents the event's commit wrote, before and after: a resumed run reads its
    /// earlier lives' effects from here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub writes: Vec<DocWrite>,
}

/// The writes `events` record, grouped by document (namespace, key), each group in commit
/// order.
pub fn writes_by_document(
    events: &[Event],
) -> std::collections::BTreeMap<(&str, &str), Vec<crate::store::undo::WriteTexts<'_>>> {
    let mut by_doc: std::collections::BTreeMap<(&str, &str), Vec<_>> = std::collections::BTreeMap::new();
    for write in events.iter().flat_map(|e| &e.writes) {
        by_doc
            .entry((&write.ns, &write.key))
            .or_default()
            .push(crate::store::undo::WriteTexts { before: write.before.as_deref(), after: write.after.as_deref() });
    }
    by_doc
}

/// What the first failed step of `journal` failed with, for a message: `step 'id' failed:
/// code: message`.
pub fn first_failure(journal: &[Event]) -> Option<String> {
    let failed = journal.iter().find(|e| e.event == EventKind::StepFailed)?;
    let error = failed.error.as_ref().map_or("no error recorded".to_string(), |e| format!("{}: {}", e.code, e.message));
    Some(format!("step '{}' failed: {error}", failed.step.as_deref().unwrap_or("?")))
}

/// One document a commit wrote (`None`: no document).
///
/// A journal record holds the documents as JSON (`old`, `new`; absent: no document), not as
/// strings of JSON text: no escaped quotes to store (CT1's journal is 8 % smaller), nothing to
/// unescape when read. Records written before that (`before`, `after`: the texts) are still read.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(from = "DocWriteRecord")]
pub struct DocWrite {
    pub ns: String,
    pub key: String,
    /// Shared with the store's own copy: recording a write copies no document.
    pub before: Option<Arc<str>>,
    pub after: Option<Arc<str>>,
}

/// [`DocWrite`] as a journal record spells it, read back.
#[derive(Deserialize)]
struct DocWriteRecord {
    ns: String,
    key: String,
    #[serde(default, deserialize_with = "present")]
    old: Option<Box<RawValue>>,
    #[serde(default, deserialize_with = "present")]
    new: Option<Box<RawValue>>,
    /// The texts, as records held them before `old` and `new`.
    #[serde(default)]
    before: Option<Arc<str>>,
    #[serde(default)]
    after: Option<Arc<str>>,
}

/// The same record as written: borrowed from the [`DocWrite`], so recording a commit copies
/// neither its names nor its documents.
#[derive(Serialize)]
struct DocWriteOut<'a> {
    ns: &'a str,
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    old: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    new: Option<&'a RawValue>,
}

/// A field that is there holds a document, even the document `null`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Box<RawValue>>, D::Error> {
    Box::<RawValue>::deserialize(d).map(Some)
}

impl Serialize for DocWrite {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // The store's texts are canonical JSON; anything else is refused, never dropped.
        let (old, new) = (self.before.as_deref(), self.after.as_deref());
        let record = DocWriteOut {
            ns: &self.ns,
            key: &self.key,
            old: old.map(crate::json::as_raw::<S::Error>).transpose()?,
            new: new.map(crate::json::as_raw::<S::Error>).transpose()?,
        };
        record.serialize(serializer)
    }
}

impl From<DocWriteRecord> for DocWrite {
    fn from(r: DocWriteRecord) -> Self {
        let text = |raw: Option<Box<RawValue>>, legacy: Option<Arc<str>>| raw.map(|v| Arc::from(v.get())).or(legacy);
        DocWrite { ns: r.ns, key: r.key, before: text(r.old, r.before), after: text(r.new, r.after) }
    }
}

impl Event {
    /// An event of `kind` with nothing but its kind filled in.
    pub fn new(kind: EventKind) -> Event {
        Event {
            seq: 0,
            run_id: String::new(),
            event: kind,
            at_us: 0,
            step: None,
            tool: None,
            compensator: None,
            attempt: None,
            idempotency_key: None,
            duration_us: None,
            replayed: None,
            error: None,
            data: None,
            writes: Vec::new(),
        }
    }

    pub fn step(mut self, step: &str, tool: &str) -> Event {
        self.step = Some(step.to_string());
        self.tool = Some(tool.to_string());
        self
    }

    pub fn attempt(mut self, attempt: u32, key: &str) -> Event {
        self.attempt = Some(attempt);
        self.idempotency_key = Some(key.to_string());
        self
    }

    pub fn error(mut self, error: ErrorInfo) -> Event {
        self.error = Some(error);
        self
    }

    pub fn data(mut self, data: impl Into<Arc<Value>>) -> Event {
        self.data = Some(data.into());
        self
    }
}

/// Where events go as they happen, besides the run's report.
pub trait JournalSink: Send + Sync {
    fn append(&self, events: &[Event]);
}

/// A JSON Lines file, flushed after every batch so that a crash loses no recorded event.
pub struct JsonLinesFile {
    file: Mutex<std::fs::File>,
}

impl JsonLinesFile {
    pub fn create(path: &Path) -> std::io::Result<JsonLinesFile> {
        Ok(JsonLinesFile { file: Mutex::new(std::fs::File::create(path)?) })
    }
}

impl JournalSink for JsonLinesFile {
    fn append(&self, events: &[Event]) {
        let mut text = String::new();
        for event in events {
            if let Ok(line) = serde_json::to_string(event) {
                text.push_str(&line);
                text.push('\n');
            }
        }
        let mut file = lock(&self.file);
        if let Err(e) = file.write_all(text.as_bytes()).and_then(|_| file.flush()) {
            tracing::error!("cannot write the journal: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(before: Option<&str>, after: Option<&str>) -> DocWrite {
        DocWrite {
            ns: "flights".into(),
            key: "HAT001".into(),
            before: before.map(Arc::from),
            after: after.map(Arc::from),
        }
    }

    fn record(writes: Vec<DocWrite>) -> Event {
        let mut event = Event::new(EventKind::StepCompleted);
        event.writes = writes;
        event
    }

    #[test]
    fn documents_are_recorded_as_json_and_read_back_as_the_same_texts() {
        let event = record(vec![
            write(Some(r#"{"dates":{"2024-05-16":{"seats":9}},"name":"a \"quoted\" \\ name"}"#), None),
            write(None, Some("null")),
            write(Some(r#""just a string""#), Some("[1,2.5,-3]")),
        ]);
        let line = serde_json::to_string(&event).unwrap();
        assert!(line.contains(r#""old":{"dates":{"2024-05-16":{"seats":9}}"#), "{line}");
        assert!(line.contains(r#""new":null"#) && line.contains(r#""old":"just a string""#), "{line}");
        assert!(!line.contains("\"before\"") && !line.contains("\"after\""), "{line}");
        let back: Event = serde_json::from_str(&line).unwrap();
        assert_eq!(back, event, "the document null, or an absent one, was mistaken for the other");
    }

    #[test]
    fn records_that_held_documents_as_text_are_still_read() {
        let legacy = r#"{"seq":3,"run_id":"r","event":"step_completed","at_us":9,"writes":[
            {"ns":"flights","key":"HAT001","before":"{\"seats\":9}","after":null},
            {"ns":"flights","key":"HAT002","before":null,"after":"\"text\""}]}"#;
        let event: Event = serde_json::from_str(legacy).unwrap();
        assert_eq!(
            event.writes,
            vec![
                write(Some(r#"{"seats":9}"#), None),
                DocWrite { key: "HAT002".into(), ..write(None, Some(r#""text""#)) }
            ]
        );
    }

    #[test]
    fn shared_data_is_written_and_read_as_plain_json() {
        // A line an earlier build wrote, when `data` was not shared: still read, and written
        // back byte for byte.
        let line = r#"{"seq":0,"run_id":"r","event":"step_started","at_us":5,"data":{"cabin":"economy","n":[1,2]}}"#;
        let event: Event = serde_json::from_str(line).unwrap();
        assert_eq!(event.data.as_deref(), Some(&serde_json::json!({ "cabin": "economy", "n": [1, 2] })));
        assert_eq!(serde_json::to_string(&event).unwrap(), line);
        // Two events built from one tree share it.
        let args = Arc::new(serde_json::json!({ "cabin": "economy" }));
        let (first, second) = (
            Event::new(EventKind::StepStarted).data(args.clone()),
            Event::new(EventKind::StepStarted).data(args.clone()),
        );
        assert!(Arc::ptr_eq(first.data.as_ref().unwrap(), second.data.as_ref().unwrap()));
    }

    #[test]
    fn a_text_that_is_not_json_is_refused_rather_than_dropped() {
        let err = serde_json::to_string(&record(vec![write(Some("{not json"), None)])).unwrap_err();
        assert!(err.to_string().contains("key must be a string"), "{err}");
    }
}
