//! What the backends' own tests share.

use std::sync::Arc;

use serde_json::{Value, json};

use super::Backend;
use crate::saga::journal::{Event, EventKind};
use crate::store::{Txn, WriteQuota};

pub fn event(run_id: &str, seq: u64, kind: EventKind) -> Event {
    let mut event = Event::new(kind);
    event.run_id = run_id.into();
    event.seq = seq;
    event
}

/// A transaction that adds one to the counter `pools/{counter}` and writes `marks/{key}`.
pub fn counting(db: &dyn Backend, counter: &str, key: &str) -> Txn {
    let mut txn = Txn::new(db.snapshot(), WriteQuota::default());
    let n = txn
        .get("pools", counter)
        .map_or(0, |t| serde_json::from_str::<Value>(&t).unwrap()["allocated"].as_u64().unwrap());
    txn.put("pools", counter, &json!({ "allocated": n + 1 }).to_string()).unwrap();
    txn.put("marks", key, "{}").unwrap();
    txn
}

/// Runs `run0`..`run{threads-1}` at once, each committing `commits` steps on a counter of
/// its own (nothing conflicts, so nothing may fail); returns how many commits were made.
pub fn commit_at_once(db: Arc<dyn Backend>, threads: usize, commits: u64) -> u64 {
    let barrier = Arc::new(std::sync::Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (db, barrier) = (db.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let run = format!("run{t}");
                for seq in 0..commits {
                    let txn = counting(&*db, &run, &format!("{t}-{seq}"));
                    db.commit(&txn, None, &[event(&run, seq, EventKind::StepCompleted)]).unwrap();
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    threads as u64 * commits
}

/// `db` (opened anew) holds every commit [`commit_at_once`] made, once, with its record.
pub fn assert_every_commit_there(db: &dyn Backend, threads: usize, commits: u64) {
    let state = db.current_state().unwrap();
    assert_eq!(state.namespace("marks").unwrap().len() as u64, threads as u64 * commits);
    for t in 0..threads {
        let counter: Value = serde_json::from_str(&state.get("pools", &format!("run{t}")).unwrap().text).unwrap();
        assert_eq!(counter["allocated"], commits, "a commit of run{t} was lost or applied twice");
        let seqs: Vec<u64> = db.events(&format!("run{t}")).unwrap().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (0..commits).collect::<Vec<_>>());
    }
}
