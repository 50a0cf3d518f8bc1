//! What `find` returned on a namespace, kept with the namespace until a write changes it.
//!
//! A verification campaign runs every case from the same fixture, and an agent's session
//! searches a namespace many times between writes: the same find on the same unchanged
//! documents scanned them all again each time (tau-bench's flight searches read 1.3 MB
//! each). Copies of a namespace share its memo; the copy a commit writes starts a new one.

use std::sync::{Arc, Mutex, OnceLock};

use super::FieldIs;
use crate::sync::lock;

/// Finds kept per namespace; the oldest is forgotten past this.
const KEPT: usize = 32;

/// Matches an answer may hold to be kept: what a memo holds stays bounded (32 × 1,024 keys
/// per namespace), and an answer that large costs more to copy to the plugin than to find.
const KEPT_MATCHES: usize = 1024;

/// A find's question: its key prefix and its conditions, values canonical.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Question {
    pub prefix: String,
    pub conditions: Vec<FieldIs>,
}

/// A find's answer on the namespace as it was.
#[derive(Debug)]
pub(super) struct Answer {
    /// Documents in the prefix's range: the listing cap applies to these, whatever matched.
    pub looked_at: usize,
    pub found: Vec<(String, Arc<str>)>,
}

/// A question with its answer.
type Answered = (Question, Arc<Answer>);

/// The finds answered on one version of a namespace, oldest first. Empty until the first
/// find keeps an answer, so a write that forgets it allocates nothing: commits write far
/// more namespaces than finds search.
#[derive(Clone, Debug, Default)]
pub(super) struct Memo(OnceLock<Arc<Mutex<Vec<Answered>>>>);

impl Memo {
    pub fn get(&self, question: &Question) -> Option<Arc<Answer>> {
        let kept = lock(self.0.get()?);
        kept.iter().find(|(q, _)| q == question).map(|(_, a)| a.clone())
    }

    pub fn keep(&self, question: Question, answer: Arc<Answer>) {
        if answer.found.len() > KEPT_MATCHES {
            return;
        }
        let mut kept = lock(self.0.get_or_init(Arc::default));
        // Two calls may have scanned for the same question at once.
        if kept.iter().any(|(q, _)| *q == question) {
            return;
        }
        if kept.len() >= KEPT {
            kept.remove(0);
        }
        kept.push((question, answer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn question(prefix: usize) -> Question {
        Question { prefix: prefix.to_string(), conditions: Vec::new() }
    }

    fn answer(matches: usize) -> Arc<Answer> {
        let doc: Arc<str> = Arc::from("{}");
        Arc::new(Answer { looked_at: matches, found: (0..matches).map(|i| (i.to_string(), doc.clone())).collect() })
    }

    #[test]
    fn a_memo_keeps_the_latest_answers_of_a_bounded_size() {
        let memo = Memo::default();
        for prefix in 0..=KEPT {
            memo.keep(question(prefix), answer(1));
        }
        assert!(memo.get(&question(0)).is_none(), "the oldest is forgotten");
        assert!((1..=KEPT).all(|p| memo.get(&question(p)).is_some()));
        memo.keep(question(KEPT + 1), answer(KEPT_MATCHES + 1));
        assert!(memo.get(&question(KEPT + 1)).is_none(), "too large to keep");
        memo.keep(question(KEPT + 2), answer(KEPT_MATCHES));
        assert_eq!(memo.get(&question(KEPT + 2)).unwrap().found.len(), KEPT_MATCHES);
        memo.keep(question(KEPT + 2), answer(1));
        assert_eq!(memo.get(&question(KEPT + 2)).unwrap().found.len(), KEPT_MATCHES, "kept once");
        // Copies share what they keep.
        let copy = memo.clone();
        copy.keep(question(KEPT + 3), answer(2));
        assert!(memo.get(&question(KEPT + 3)).is_some());
    }
}
