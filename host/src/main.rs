//! The `sagabox` command line.

mod cli;

/// Calls, commits and journal records allocate many small, short-lived buffers across tokio's
/// threads; glibc's allocator spent a quarter of a rolled-back saga's time on them. jemalloc
/// over mimalloc: as fast here, and its peak RSS with 1,000 sagas alive stays at glibc's
/// (mimalloc added 30 MiB).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
