//! Group commit: callers that commit at the same time share one transaction.
//!
//! Each caller queues its request and waits. Whoever finds no batch being written becomes
//! the leader: it takes every request queued so far (its own among them), writes them in
//! one transaction, hands each caller its outcome, and wakes them. Requests that arrive
//! meanwhile form the next batch. One caller alone is a batch of one, so nothing waits for
//! company; under load, the transaction's fixed cost (and its fsync) is shared.
//!
//! A batch's end wakes its own callers and the first caller queued after them (to lead the
//! next batch), each by its thread, not every waiting thread: woken all at once, the callers
//! of the next batch woke only to sleep again, after fighting for the queue's lock.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
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
    /// Requests not yet taken by a leader, with their callers' threads.
    waiting: Vec<(u64, R, Thread)>,
    /// The callers of the batch being written, but the leader.
    writing: Vec<Thread>,
    /// Outcomes not yet taken by their caller; `None`: the batch's leader panicked.
    outcomes: HashMap<u64, Option<O>>,
    next_ticket: u64,
    leading: bool,
    /// Batches written so far: how well requests were grouped.
    batches: u64,
    /// Time spent writing them: against the wall time, how busy the writer was.
    writing_time: Duration,
}

/// The leader of the batch that held a request panicked; nothing is known of its outcome.
#[derive(Debug)]
pub struct LeaderPanicked;

impl<R, O> Group<R, O> {
    pub fn new(max_batch: usize) -> Group<R, O> {
        Group {
            queue: Mutex::new(Queue {
                waiting: Vec::new(),
                writing: Vec::new(),
                outcomes: HashMap::new(),
                next_ticket: 0,
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
        let mut queue = lock(&self.queue);
        let ticket = queue.next_ticket;
        queue.next_ticket += 1;
        queue.waiting.push((ticket, request, std::thread::current()));
        loop {
            if let Some(outcome) = queue.outcomes.remove(&ticket) {
                return outcome.ok_or(LeaderPanicked);
            }
            if queue.leading {
                // Woken by the end of the batch holding the request, or to lead the next one;
                // a wake-up for neither (`park` may return spuriously) just waits again.
                drop(queue);
                std::thread::park();
                queue = lock(&self.queue);
                continue;
            }
            queue.leading = true;
            let take = queue.waiting.len().min(self.max_batch);
            let (mut tickets, mut requests) = (Vec::with_capacity(take), Vec::with_capacity(take));
            let Queue { waiting, writing, .. } = &mut *queue;
            for (t, request, thread) in waiting.drain(..take) {
                if t != ticket {
                    writing.push(thread);
                }
                tickets.push(t);
                requests.push(request);
            }
            drop(queue);
            let mut leading = Leading { group: self, tickets, own: ticket };
            let started = Instant::now();
            let outcomes = write(requests);
            queue = leading.finish(outcomes, started.elapsed());
        }
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

/// A batch being written: its callers learn its outcome even if `write` panics.
struct Leading<'a, R, O> {
    group: &'a Group<R, O>,
    tickets: Vec<u64>,
    /// The leader's own ticket: if it panics, nobody is left to collect that outcome.
    own: u64,
}

impl<'a, R, O> Leading<'a, R, O> {
    fn finish(&mut self, outcomes: Vec<O>, took: Duration) -> MutexGuard<'a, Queue<R, O>> {
        let mut queue = lock(&self.group.queue);
        let mut outcomes = outcomes.into_iter();
        for ticket in std::mem::take(&mut self.tickets) {
            // A missing outcome is reported like a panic: never a hang.
            queue.outcomes.insert(ticket, outcomes.next());
        }
        queue.leading = false;
        queue.batches += 1;
        queue.writing_time += took;
        wake_after_batch(&mut queue);
        queue
    }
}

impl<R, O> Drop for Leading<'_, R, O> {
    fn drop(&mut self) {
        if self.tickets.is_empty() {
            return;
        }
        let mut queue = lock(&self.group.queue);
        for ticket in std::mem::take(&mut self.tickets) {
            if ticket != self.own {
                queue.outcomes.insert(ticket, None);
            }
        }
        // The leader's own request, if a later batch was to hold it, is withdrawn with it.
        let own = self.own;
        queue.waiting.retain(|(ticket, _, _)| *ticket != own);
        queue.leading = false;
        wake_after_batch(&mut queue);
    }
}

/// Wakes the callers of the batch just written (their outcomes are in) and the first caller
/// still queued, who leads the next batch.
fn wake_after_batch<R, O>(queue: &mut Queue<R, O>) {
    for thread in queue.writing.drain(..) {
        thread.unpark();
    }
    if let Some((_, _, next)) = queue.waiting.first() {
        next.unpark();
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
        assert!(lock(&group.queue).outcomes.is_empty(), "an outcome nobody collects was kept");
        let short = group.submit(3, |_| Vec::new());
        assert!(short.is_err(), "a request without an outcome must not hang or invent one");
    }
}
