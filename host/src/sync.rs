//! Mutexes the host keeps using after a panic.

use std::sync::{Mutex, MutexGuard};

/// `m`'s guard, also when a thread panicked while holding it: what these mutexes guard is
/// consistent between statements, and one failed request must not stop the next.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
