//! What one run did to a document, told apart from what other runs did to it meanwhile.
//!
//! A run's writes are kept as (before, after) texts. When nobody else wrote a document
//! between them, the run's net change is simply its first `before` against the document now.
//! When other runs' writes are interleaved (shared seat counts, pools, balances), the run's
//! own edits are undone, newest first, on the document as it is now, at the finest level:
//! a number it changed by `d` is moved back by `d` (other runs' changes to the same number
//! stay), any other field it changed is put back. What is left is the document as it would
//! be without this run; the difference to now is this run's net change.

use serde_json::{Map, Number, Value};

/// One document write, as its texts (`None`: no document).
#[derive(Clone, Copy, Debug)]
pub struct WriteTexts<'a> {
    pub before: Option<&'a str>,
    pub after: Option<&'a str>,
}

/// `now` without the edits of `writes` (in commit order), as canonical text: the document as
/// it would be had the run not written it.
pub fn without_writes(now: Option<&str>, writes: &[WriteTexts<'_>]) -> Option<String> {
    let contiguous = writes.windows(2).all(|w| w[0].after == w[1].before);
    if contiguous && writes.last().is_some_and(|w| w.after == now) {
        // Nobody else wrote it in between or since: the run's first `before` is the answer.
        return writes[0].before.map(str::to_string);
    }
    let parse = |text: Option<&str>| text.and_then(|t| serde_json::from_str::<Value>(t).ok());
    let mut doc = parse(now);
    for write in writes.iter().rev() {
        let (before, after) = (parse(write.before), parse(write.after));
        undo(&mut doc, "", before.as_ref(), after.as_ref());
    }
    doc.map(|d| crate::json::canonical(&d))
}

/// Undoes, on `doc`, the edit that turned `before` into `after` at `path`.
fn undo(doc: &mut Option<Value>, path: &str, before: Option<&Value>, after: Option<&Value>) {
    match (before, after) {
        _ if before == after => {}
        (Some(Value::Object(b)), Some(Value::Object(a))) => {
            for key in b.keys().chain(a.keys().filter(|k| !b.contains_key(*k))) {
                let escaped = key.replace('~', "~0").replace('/', "~1");
                undo(doc, &format!("{path}/{escaped}"), b.get(key), a.get(key));
            }
        }
        (Some(Value::Number(b)), Some(Value::Number(a))) => {
            if let Some(Value::Number(now)) = at(doc, path) {
                let moved = add(now, b, a);
                put(doc, path, moved);
            }
        }
        _ => put(doc, path, before.cloned()),
    }
}

/// `now + (before - after)`, in integers when all three are integers.
fn add(now: &Number, before: &Number, after: &Number) -> Option<Value> {
    if let (Some(n), Some(b), Some(a)) = (now.as_i64(), before.as_i64(), after.as_i64())
        && let Some(sum) = b.checked_sub(a).and_then(|d| n.checked_add(d))
    {
        return Some(Value::from(sum));
    }
    let sum = now.as_f64()? + before.as_f64()? - after.as_f64()?;
    Number::from_f64(sum).map(Value::Number)
}

fn segments(path: &str) -> impl Iterator<Item = String> + '_ {
    path.split('/').skip(1).map(|s| s.replace("~1", "/").replace("~0", "~"))
}

fn at<'a>(doc: &'a Option<Value>, path: &str) -> Option<&'a Value> {
    segments(path).try_fold(doc.as_ref()?, |v, s| v.as_object()?.get(&s))
}

/// Sets (or, with `None`, removes) the value at `path`; a path whose parent is gone is left.
fn put(doc: &mut Option<Value>, path: &str, value: Option<Value>) {
    let names: Vec<String> = segments(path).collect();
    let Some((last, parents)) = names.split_last() else {
        *doc = value;
        return;
    };
    let Some(mut object) = doc.as_mut().and_then(Value::as_object_mut) else { return };
    for name in parents {
        let Some(next) = object.get_mut(name).and_then(Value::as_object_mut) else { return };
        object = next;
    }
    set(object, last, value);
}

fn set(object: &mut Map<String, Value>, name: &str, value: Option<Value>) {
    match value {
        Some(v) => {
            object.insert(name.to_string(), v);
        }
        None => {
            object.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w<'a>(before: Option<&'a str>, after: Option<&'a str>) -> WriteTexts<'a> {
        WriteTexts { before, after }
    }

    #[test]
    fn alone_the_first_before_is_the_answer() {
        let writes = [w(Some(r#"{"n":1}"#), Some(r#"{"n":2}"#)), w(Some(r#"{"n":2}"#), Some(r#"{"n":1}"#))];
        assert_eq!(without_writes(Some(r#"{"n":1}"#), &writes).as_deref(), Some(r#"{"n":1}"#));
        let created = [w(None, Some(r#"{"n":1}"#))];
        assert_eq!(without_writes(Some(r#"{"n":1}"#), &created), None);
    }

    #[test]
    fn interleaved_counts_keep_the_other_runs_share() {
        // This run took a seat (10 -> 9) and gave it back (8 -> 9); another run took one
        // in between and kept it. Without this run the count is 9, as it is now.
        let writes =
            [w(Some(r#"{"seats":10}"#), Some(r#"{"seats":9}"#)), w(Some(r#"{"seats":8}"#), Some(r#"{"seats":9}"#))];
        assert_eq!(without_writes(Some(r#"{"seats":9}"#), &writes).as_deref(), Some(r#"{"seats":9}"#));
        // This run took one and kept it; the other run took one too: without it, 9 not 8.
        let kept = [w(Some(r#"{"seats":9}"#), Some(r#"{"seats":8}"#))];
        assert_eq!(without_writes(Some(r#"{"seats":7}"#), &kept).as_deref(), Some(r#"{"seats":8}"#));
    }

    #[test]
    fn fields_and_documents_are_put_back() {
        let writes = [
            w(None, Some(r#"{"a":{"x/y":1},"s":"new"}"#)),
            w(Some(r#"{"a":{"x/y":1},"s":"new"}"#), Some(r#"{"a":{"x/y":2},"s":"done"}"#)),
        ];
        // Someone else added a field since: the run created the document, so without it there is none.
        assert_eq!(without_writes(Some(r#"{"a":{"x/y":2},"s":"done","t":1}"#), &writes), None);
        let edit = [w(Some(r#"{"s":"a","gone":1}"#), Some(r#"{"s":"b"}"#))];
        assert_eq!(
            without_writes(Some(r#"{"other":true,"s":"b"}"#), &edit).as_deref(),
            Some(r#"{"gone":1,"other":true,"s":"a"}"#)
        );
        let floats = [w(Some(r#"{"p":1.5}"#), Some(r#"{"p":1}"#))];
        assert_eq!(without_writes(Some(r#"{"p":3}"#), &floats).as_deref(), Some(r#"{"p":3.5}"#));
    }
}
