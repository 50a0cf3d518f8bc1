//! Group commit: callers that commit at the same time share one transaction.
//!
//! Each caller queues its request and waits on a slot of its own. Whoever finds no batch
//! being written becomes the leader: it takes every request queued so far (its own among
//! them), writes them in one transaction, puts each caller's outcome in that caller's slot,
//! and wakes it. Requests that arrive meanwhile form the next batch, which the first of
//! their callers is woken to lead. One caller alone is a batch of one, so nothing waits for
//! company; under load, the transaction's fixed cost (and its fsync) is shared.
//!
//! A woken caller reads its own slot, not the shared queue. When callers looked for their
//! outcomes under the queue's lock, the ones woken at a batch's end and the ones queueing
//! the next batch took that lock in turn, each waiting to be scheduled before it could
//! (a lock convoy): 64 durable runs in flight spent nine tenths of their time in commits
//! whose transactions took a tenth of that, and a transaction held 8 steps, not 70.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::lock;

/// Requests of type `R` waiting to be written, and outcomes of type `O` to hand back.
pub struct Group<R, O> {
    queue: Mutex<Queue<R, O>>,
    /// Most requests one batch takes: a bound on how long its transaction runs.
    max_batch: usize,
}

struct Queue<R, O> {
    /// Requests not yet taken by a leader, with their callers' slots, oldest first.
    waiting: VecDeque<(R, Arc<Slot<O>>)>,
    leading: bool,
    /// Batches written so far: how well requests were grouped.
    batches: u64,
    /// Time spent writing them: against the wall time, how busy the writer was.
    writing_time: Duration,
}

/// Where one caller waits, woken when its turn comes.
struct Slot<O> {
    turn: Mutex<Turn<O>>,
    caller: Thread,
}

enum Turn<O> {
    Waiting,
    /// The batch before ended with this caller's request still queued: it leads the next.
    Lead,
    /// Its request was written; `None`: the batch's leader panicked.
    Done(Option<O>),
}

impl<O> Slot<O> {
    fn of_this_thread() -> Arc<Slot<O>> {
        Arc::new(Slot { turn: Mutex::new(Turn::Waiting), caller: std::thread::current() })
    }

    fn give(&self, turn: Turn<O>) {
        *lock(&self.turn) = turn;
        self.caller.unpark();
    }

    /// Waits for the caller's turn (`park` may return spuriously: it then waits again).
    fn wait(&self) -> Turn<O> {
        loop {
            let mut turn = lock(&self.turn);
            if !matches!(*turn, Turn::Waiting) {
                return std::mem::replace(&mut *turn, Turn::Waiting);
            }
            drop(turn);
            std::thread::park();
        }
    }
}

/// The leader of the batch that held a request panicked; nothing is known of its outcome.
#[derive(Debug)]
pub struct LeaderPanicked;

impl<R, O> Group<R, O> {
    pub fn new(max_batch: usize) -> Group<R, O> {
        Group {
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                leading: false,
                batches: 0,
                writing_time: Duration::ZERO,
            }),
            max_batch: max_batch.max(1),
        }
    }

    /// Queues `request` and returns its outcome once a batch holding it was written by
    /// `write`, which gets the batch's requests in arrival order and returns their outcomes
    /// in the same order.
    pub fn submit(&self, request: R, write: impl Fn(Vec<R>) -> Vec<O>) -> Result<O, LeaderPanicked> {
        let own = Slot::of_this_thread();
        let leads = {
            let mut queue = lock(&self.queue);
            queue.waiting.push_back((request, own.clone()));
            !std::mem::replace(&mut queue.leading, true)
        };
        if !leads {
            match own.wait() {
                Turn::Done(outcome) => return outcome.ok_or(LeaderPanicked),
                Turn::Lead | Turn::Waiting => {}
            }
        }
        Leading { group: self, batch: Vec::new(), own, passed_on: false }.write_until_own_is_done(write)
    }

    /// Batches written so far.
    pub fn batches(&self) -> u64 {
        lock(&self.queue).batches
    }

    /// Time spent writing batches so far.
    pub fn writing_time(&self) -> Duration {
        lock(&self.queue).writing_time
    }
}

/// The lead, held by one caller at a time: its callers learn their outcomes, and the lead
/// passes on, even if `write` panics.
struct Leading<'a, R, O> {
    group: &'a Group<R, O>,
    /// The slots of the batch being written.
    batch: Vec<Arc<Slot<O>>>,
    own: Arc<Slot<O>>,
    /// Whether the lead was passed on: what is left to do if the leader stops before.
    passed_on: bool,
}

impl<R, O> Leading<'_, R, O> {
    /// Writes batches until one held the leader's own request (more than a batch may be
    /// queued ahead of it), then hands the lead on and returns that request's outcome.
    fn write_until_own_is_done(mut self, write: impl Fn(Vec<R>) -> Vec<O>) -> Result<O, LeaderPanicked> {
        loop {
            let requests = self.take_batch();
            let started = Instant::now();
            let outcomes = write(requests);
            let took = started.elapsed();
            let own = self.hand_out(outcomes);
            let mut queue = lock(&self.group.queue);
            queue.batches += 1;
            queue.writing_time += took;
            if let Some(outcome) = own {
                pass_the_lead(&mut queue);
                self.passed_on = true;
                return outcome.ok_or(LeaderPanicked);
            }
        }
    }

    fn take_batch(&mut self) -> Vec<R> {
        let mut queue = lock(&self.group.queue);
        let take = queue.waiting.len().min(self.group.max_batch);
        let mut requests = Vec::with_capacity(take);
        for (request, slot) in queue.waiting.drain(..take) {
            requests.push(request);
            self.batch.push(slot);
        }
        requests
    }

    /// Gives each caller of the batch its outcome, in order (a missing one is reported like
    /// a panic: never a hang); returns the leader's own, if its request was in the batch.
    fn hand_out(&mut self, outcomes: Vec<O>) -> Option<Option<O>> {
        let mut outcomes = outcomes.into_iter();
        let mut own = None;
        for slot in self.batch.drain(..) {
            let outcome = outcomes.next();
            if Arc::ptr_eq(&slot, &self.own) {
                own = Some(outcome);
            } else {
                slot.give(Turn::Done(outcome));
            }
        }
        own
    }
}

impl<R, O> Drop for Leading<'_, R, O> {
    fn drop(&mut self) {
        // Not `thread::panicking()`: a commit made while the thread unwinds from another
        // panic (in a `Drop`) ends normally, and its lead must not be passed on twice.
        if self.passed_on {
            return;
        }
        for slot in self.batch.drain(..) {
            if !Arc::ptr_eq(&slot, &self.own) {
                slot.give(Turn::Done(None));
            }
        }
        // The leader's own request, if a later batch was to hold it, is withdrawn with it.
        let mut queue = lock(&self.group.queue);
        queue.waiting.retain(|(_, slot)| !Arc::ptr_eq(slot, &self.own));
        pass_the_lead(&mut queue);
    }
}

/// Wakes the first caller still queued to lead the next batch, or leaves the lead free.
fn pass_the_lead<R, O>(queue: &mut Queue<R, O>) {
    match queue.waiting.front() {
        Some((_, next)) => next.give(Turn::Lead),
        None => queue.leading = false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    #[test]
    fn concurrent_callers_share_batches_and_each_gets_its_own_outcome() {
        let group = Arc::new(Group::<u32, u32>::new(64));
        let callers = 16;
        let barrier = Arc::new(Barrier::new(callers));
        let threads: Vec<_> = (0..callers as u32)
            .map(|n| {
                let (group, barrier) = (group.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    (0..50)
                        .map(|i| {
                            let request = n * 1000 + i;
                            let outcome = group
                                .submit(request, |batch| {
                                    // Long enough for others to queue behind the leader.
                                    std::thread::sleep(std::time::Duration::from_micros(200));
                                    batch.iter().map(|r| r * 2).collect()
                                })
                                .unwrap();
                            (request, outcome)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for thread in threads {
            for (request, outcome) in thread.join().unwrap() {
                assert_eq!(outcome, request * 2);
            }
        }
        let batches = group.batches();
        assert!(batches < 16 * 50 / 2, "{batches} batches for 800 requests: they were not grouped");
    }

    #[test]
    fn callers_queued_behind_a_batch_are_each_woken_even_when_they_fill_several_batches() {
        // Two requests a batch and eight callers: most wait behind one or more batches, and
        // each batch's end must wake its own callers and whoever leads the next.
        let group = Arc::new(Group::<u32, u32>::new(2));
        let barrier = Arc::new(Barrier::new(8));
        let (done, finished) = std::sync::mpsc::channel();
        for n in 0..8u32 {
            let (group, barrier, done) = (group.clone(), barrier.clone(), done.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let outcome = group.submit(n, |batch| {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    batch.iter().map(|r| r + 100).collect()
                });
                done.send((n, outcome.unwrap())).unwrap();
            });
        }
        for _ in 0..8 {
            let (n, outcome) =
                finished.recv_timeout(std::time::Duration::from_secs(20)).expect("a caller was never woken");
            assert_eq!(outcome, n + 100);
        }
    }

    #[test]
    fn a_panicking_leader_fails_its_batch_and_later_requests_go_on() {
        let group = Group::<u32, u32>::new(8);
        let panicked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| group.submit(1, |_| panic!("the writer failed"))));
        assert!(panicked.is_err());
        assert_eq!(group.submit(2, |batch| batch).unwrap(), 2);
        let queue = lock(&group.queue);
        assert!(queue.waiting.is_empty() && !queue.leading, "the panicked batch left a request or the lead behind");
        drop(queue);
        let short = group.submit(3, |_| Vec::new());
        assert!(short.is_err(), "a request without an outcome must not hang or invent one");
    }

    /// Waits until `n` requests are queued (a leader is writing meanwhile).
    fn until_queued(group: &Group<u32, u32>, n: usize) {
        while lock(&group.queue).waiting.len() < n {
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_caller_whose_request_was_written_returns_without_the_queues_lock() {
        // L writes batch 1 alone while B, then C queue; B leads batch 2, which holds C's
        // request. While B hands out its outcomes, another thread holds the queue's lock:
        // C must return all the same. (When callers looked for their outcomes under that
        // lock, each woken caller waited for it in turn: a convoy that kept batches small.)
        use std::sync::mpsc::channel;
        let group = Arc::new(Group::<u32, u32>::new(64));
        let (take_lock, told_to_take) = channel::<()>();
        let (lock_held, held) = channel::<()>();
        let (c_returned, c_is_back) = channel::<()>();
        let holder = {
            let group = group.clone();
            std::thread::spawn(move || {
                told_to_take.recv().unwrap();
                let queue = lock(&group.queue);
                lock_held.send(()).unwrap();
                let c_came_back = c_is_back.recv_timeout(std::time::Duration::from_secs(10)).is_ok();
                drop(queue);
                c_came_back
            })
        };
        let (began, batch_1_began) = channel::<()>();
        let l = {
            let group = group.clone();
            std::thread::spawn(move || {
                group.submit(0, |batch| {
                    began.send(()).unwrap();
                    until_queued(&group, 2);
                    batch
                })
            })
        };
        batch_1_began.recv().unwrap();
        let b = {
            let group = group.clone();
            std::thread::spawn(move || {
                group.submit(1, |batch| {
                    take_lock.send(()).unwrap();
                    held.recv().unwrap();
                    batch.iter().map(|r| r + 100).collect()
                })
            })
        };
        until_queued(&group, 1);
        let c = {
            let group = group.clone();
            std::thread::spawn(move || {
                let outcome = group.submit(2, |batch| batch);
                c_returned.send(()).unwrap();
                outcome
            })
        };
        assert!(holder.join().unwrap(), "C's outcome was handed out, yet C waited for the queue's lock");
        assert_eq!(l.join().unwrap().unwrap(), 0);
        assert_eq!(b.join().unwrap().unwrap(), 101);
        assert_eq!(c.join().unwrap().unwrap(), 102);
    }

    #[test]
    fn a_caller_queued_behind_a_panicking_leader_leads_the_next_batch() {
        let group = Arc::new(Group::<u32, u32>::new(64));
        let (began, batch_began) = std::sync::mpsc::channel::<()>();
        let leader = {
            let group = group.clone();
            std::thread::spawn(move || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    group.submit(0, |_| {
                        began.send(()).unwrap();
                        until_queued(&group, 1);
                        panic!("the writer failed")
                    })
                }))
            })
        };
        batch_began.recv().unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        let queued = {
            let group = group.clone();
            std::thread::spawn(move || done.send(group.submit(1, |batch| batch.iter().map(|r| r + 100).collect())))
        };
        let outcome = finished.recv_timeout(std::time::Duration::from_secs(10));
        assert_eq!(outcome.expect("the caller queued behind the panicked leader was never woken").unwrap(), 101);
        assert!(leader.join().unwrap().is_err(), "the leader's panic reaches its caller");
        queued.join().unwrap().unwrap();
    }

    #[test]
    fn a_commit_made_while_the_thread_unwinds_ends_normally_and_frees_the_lead() {
        struct CommitsOnDrop(Arc<Group<u32, u32>>, std::sync::mpsc::Sender<Result<u32, LeaderPanicked>>);
        impl Drop for CommitsOnDrop {
            fn drop(&mut self) {
                self.1.send(self.0.submit(7, |batch| batch.iter().map(|r| r + 1).collect())).unwrap();
            }
        }
        let group = Arc::new(Group::<u32, u32>::new(8));
        let (sent, outcome) = std::sync::mpsc::channel();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _on_drop = CommitsOnDrop(group.clone(), sent);
            panic!("another failure");
        }));
        assert!(unwound.is_err());
        assert_eq!(outcome.recv().unwrap().unwrap(), 8);
        let queue = lock(&group.queue);
        assert!(queue.waiting.is_empty() && !queue.leading, "the lead was left taken");
        drop(queue);
        assert_eq!(group.submit(1, |batch| batch).unwrap(), 1);
    }
}
