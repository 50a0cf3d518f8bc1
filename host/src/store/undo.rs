//! What one run did to a document, told apart from what other runs did to it meanwhile.
//!
//! A run's writes are kept as (before, after) texts. When nobody else wrote a document
//! between them, the run's net change is simply its first `before` against the document now.
//! When other runs' writes are interleaved (shared seat counts, pools, balances), the run's
//! own edits are undone, newest first, on the document as it is now, at the finest level:
//! a number it changed by `d` is moved back by `d` (other runs' changes to the same number
//! stay), the elements it added to a list are taken out and the ones it removed put back
//! (other runs' elements stay; a list of unchanged length is undone element by element, in
//! place), any other field it changed is put back. What is left is the document as it would
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
        (Some(Value::Array(b)), Some(Value::Array(a))) => undo_list(doc, path, b, a),
        (Some(Value::Number(b)), Some(Value::Number(a))) => {
            if let Some(Value::Number(now)) = at(doc, path) {
                let moved = add(now, b, a);
                put(doc, path, moved);
            }
        }
        _ => put(doc, path, before.cloned()),
    }
}

/// Undoes, on the list at `path`, the edit that turned `before` into `after`, so that what
/// other runs did to the list meanwhile stays. Where the list kept its length throughout (the
/// edit's and the list's now), each element is undone in place, as a field is: a count in an
/// element moves back by what the run moved it, another run's edit of another field stays.
/// Otherwise the elements the edit added are taken out and the ones it removed go back where
/// they stood. An edit that only reordered the list (or a `path` that holds no list now)
/// puts `before` back whole.
fn undo_list(doc: &mut Option<Value>, path: &str, before: &[Value], after: &[Value]) {
    let Some(Value::Array(now)) = at(doc, path) else {
        return put(doc, path, Some(Value::Array(before.to_vec())));
    };
    if before.len() == after.len() && now.len() == after.len() {
        for (i, (b, a)) in before.iter().zip(after).enumerate() {
            undo(doc, &format!("{path}/{i}"), Some(b), Some(a));
        }
        return;
    }
    // Only the part between what the edit left alone at either end can differ (an append
    // is one element), so only that part is counted.
    let head = before.iter().zip(after).take_while(|(b, a)| b == a).count();
    let tail = before[head..].iter().rev().zip(after[head..].iter().rev()).take_while(|(b, a)| b == a).count();
    let (before_part, after_part) = (&before[head..before.len() - tail], &after[head..after.len() - tail]);
    let (added, removed) = (missing_from(after_part, before_part), missing_from(before_part, after_part));
    if added.is_empty() && removed.is_empty() {
        return put(doc, path, Some(Value::Array(before.to_vec())));
    }
    let mut list = now.clone();
    for element in added.iter().map(|&i| &after_part[i]) {
        if let Some(found) = list.iter().position(|e| e == element) {
            list.remove(found);
        }
    }
    for &i in &removed {
        list.insert((head + i).min(list.len()), before_part[i].clone());
    }
    put(doc, path, Some(Value::Array(list)));
}

/// The positions in `list` of the elements `other` lacks, counted as a multiset (of two equal
/// elements where `other` has one, the later one), in order.
fn missing_from(list: &[Value], other: &[Value]) -> Vec<usize> {
    let mut unmatched: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for element in other {
        *unmatched.entry(crate::json::canonical(element)).or_default() += 1;
    }
    let mut missing = Vec::new();
    for (i, element) in list.iter().enumerate() {
        match unmatched.get_mut(&crate::json::canonical(element)) {
            Some(left) if *left > 0 => *left -= 1,
            _ => missing.push(i),
        }
    }
    missing
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
    segments(path).try_fold(doc.as_ref()?, |v, s| match v {
        Value::Object(object) => object.get(&s),
        Value::Array(list) => list.get(s.parse::<usize>().ok()?),
        _ => None,
    })
}

/// Sets (or, with `None`, removes) the value at `path`; a path whose parent is gone is left,
/// and so is a list's element that is not there (a list's elements are only ever replaced).
fn put(doc: &mut Option<Value>, path: &str, value: Option<Value>) {
    let names: Vec<String> = segments(path).collect();
    let Some((last, parents)) = names.split_last() else {
        *doc = value;
        return;
    };
    let Some(mut node) = doc.as_mut() else { return };
    for name in parents {
        let next = match node {
            Value::Object(object) => object.get_mut(name),
            Value::Array(list) => name.parse::<usize>().ok().and_then(|i| list.get_mut(i)),
            _ => None,
        };
        let Some(next) = next else { return };
        node = next;
    }
    match (node, value) {
        (Value::Object(object), value) => set(object, last, value),
        (Value::Array(list), Some(value)) => {
            if let Some(slot) = last.parse::<usize>().ok().and_then(|i| list.get_mut(i)) {
                *slot = value;
            }
        }
        _ => {}
    }
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

    /// One run's edit of the shared list: `Add` appends a new element of its own; `Remove(i)`
    /// takes out the i-th element of the list as it is then (any run's, or the seed's).
    #[derive(Clone, Debug)]
    enum Edit {
        Add,
        Remove(usize),
    }

    fn edits() -> impl proptest::strategy::Strategy<Value = Vec<(usize, Edit)>> {
        use proptest::prelude::*;
        let edit = prop_oneof![Just(Edit::Add), (0..16usize).prop_map(Edit::Remove)];
        proptest::collection::vec((0..3usize, edit), 0..40)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        /// Three runs edit one list in any interleaving. Undoing one run's writes on the list as
        /// it ends leaves exactly the elements the other runs' edits leave: the seed's and the
        /// other runs' additions, less what the other runs removed.
        #[test]
        fn undoing_a_run_leaves_the_other_runs_elements(edits in edits(), run in 0..3usize) {
            let text = |list: &[String]| serde_json::json!({ "r": list }).to_string();
            let mut list: Vec<String> = (0..4).map(|i| format!("seed-{i}")).collect();
            let mut writes: Vec<(String, String)> = Vec::new();
            let mut removed_by_others = std::collections::BTreeSet::new();
            let mut added_by_others = Vec::new();
            for (n, (by, edit)) in edits.iter().enumerate() {
                let before = text(&list);
                match edit {
                    Edit::Add => {
                        let element = format!("run-{by}-{n}");
                        if *by != run {
                            added_by_others.push(element.clone());
                        }
                        list.push(element);
                    }
                    Edit::Remove(i) if *i < list.len() => {
                        let element = list.remove(*i);
                        if *by != run {
                            removed_by_others.insert(element);
                        }
                    }
                    Edit::Remove(_) => continue,
                }
                if *by == run {
                    writes.push((before, text(&list)));
                }
            }
            let texts: Vec<WriteTexts<'_>> =
                writes.iter().map(|(b, a)| w(Some(b.as_str()), Some(a.as_str()))).collect();
            let without: Value = serde_json::from_str(&without_writes(Some(&text(&list)), &texts).unwrap()).unwrap();
            let mut left: Vec<String> = serde_json::from_value(without["r"].clone()).unwrap();
            let mut expected: Vec<String> = (0..4).map(|i| format!("seed-{i}")).chain(added_by_others).collect();
            expected.retain(|e| !removed_by_others.contains(e));
            left.sort();
            expected.sort();
            proptest::prop_assert_eq!(left, expected);
        }
    }

    #[test]
    fn a_list_keeps_the_elements_other_runs_added_or_removed() {
        // What 64 CT1 runs sharing a user did (a worker run, 301 of 3,000 reports): this run
        // added R_a to the user's reservations and took it out again after another run had
        // added R_b, which that run had not yet taken out. This run's net change is nothing.
        let writes = [
            w(Some(r#"{"r":["x"]}"#), Some(r#"{"r":["x","R_a"]}"#)),
            w(Some(r#"{"r":["x","R_a","R_b"]}"#), Some(r#"{"r":["x","R_b"]}"#)),
        ];
        assert_eq!(without_writes(Some(r#"{"r":["x","R_b"]}"#), &writes).as_deref(), Some(r#"{"r":["x","R_b"]}"#));
        // This run added R_a and kept it; another added R_b since: without this run, only R_b.
        let kept = [w(Some(r#"{"r":["x"]}"#), Some(r#"{"r":["x","R_a"]}"#))];
        assert_eq!(without_writes(Some(r#"{"r":["x","R_a","R_b"]}"#), &kept).as_deref(), Some(r#"{"r":["x","R_b"]}"#));
        // This run took "y" out, where it stood; another run added "z" since.
        let removed = [w(Some(r#"{"r":["x","y","w"]}"#), Some(r#"{"r":["x","w"]}"#))];
        assert_eq!(
            without_writes(Some(r#"{"r":["x","w","z"]}"#), &removed).as_deref(),
            Some(r#"{"r":["x","y","w","z"]}"#)
        );
        // An element replaced in place goes back in its place.
        let replaced = [w(Some(r#"{"r":[1,2,3]}"#), Some(r#"{"r":[1,9,3]}"#))];
        assert_eq!(without_writes(Some(r#"{"r":[1,9,3,4]}"#), &replaced).as_deref(), Some(r#"{"r":[1,2,3,4]}"#));
        // Elements edited in place, the list's length unchanged: another run's edit of another
        // field of the same element stays, and so does its share of a count.
        let fields = [w(Some(r#"{"r":[{"a":0,"b":0,"id":1}]}"#), Some(r#"{"r":[{"a":1,"b":0,"id":1}]}"#))];
        assert_eq!(
            without_writes(Some(r#"{"r":[{"a":1,"b":1,"id":1}]}"#), &fields).as_deref(),
            Some(r#"{"r":[{"a":0,"b":1,"id":1}]}"#)
        );
        let count = [w(Some(r#"{"r":[{"n":5},{"n":7}]}"#), Some(r#"{"r":[{"n":4},{"n":7}]}"#))];
        assert_eq!(
            without_writes(Some(r#"{"r":[{"n":3},{"n":7}]}"#), &count).as_deref(),
            Some(r#"{"r":[{"n":4},{"n":7}]}"#)
        );
        // A reorder has no elements to tell apart: the run's order is put back, as before.
        let reordered = [w(Some(r#"{"r":[1,2]}"#), Some(r#"{"r":[2,1]}"#))];
        assert_eq!(without_writes(Some(r#"{"r":[2,1,3]}"#), &reordered).as_deref(), Some(r#"{"r":[1,2]}"#));
        // Duplicates count: one of two equal elements the run added goes, the other stays.
        let twice = [w(Some(r#"{"r":["a"]}"#), Some(r#"{"r":["a","a"]}"#))];
        assert_eq!(without_writes(Some(r#"{"r":["a","a","b"]}"#), &twice).as_deref(), Some(r#"{"r":["a","b"]}"#));
    }
}
