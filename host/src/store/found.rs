//! What `find` returned on a namespace, kept with the namespace until a write changes it.
//!
//! A verification campaign runs every case from the same fixture, and an agent's session
//! searches a namespace many times between writes: the same find on the same unchanged
//! documents scanned them all again each time (tau-bench's flight searches read 1.3 MB
//! each). Copies of a namespace share its memo; the copy a commit writes starts a new one.

use std::sync::{Arc, Mutex};

use super::FieldIs;

/// Finds kept per namespace; the oldest is forgotten past this.
const KEPT: usize = 32;

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

/// The finds answered on one version of a namespace, oldest first.
#[derive(Clone, Debug, Default)]
pub(super) struct Memo(Arc<Mutex<Vec<Answered>>>);

impl Memo {
    pub fn get(&self, question: &Question) -> Option<Arc<Answer>> {
        let kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        kept.iter().find(|(q, _)| q == question).map(|(_, a)| a.clone())
    }

    pub fn keep(&self, question: Question, answer: Arc<Answer>) {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= KEPT {
            kept.remove(0);
        }
        kept.push((question, answer));
    }
}
