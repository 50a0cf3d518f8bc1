//! The `sagabox` command line.

mod cli;

/// Calls, commits and journal records allocate many small, short-lived buffers across tokio's
/// threads; glibc's allocator spent a quarter of a rolled-back saga's time on them. jemalloc
/// over mimalloc: as fast here, and its peak RSS with 1,000 sagas alive stays at glibc's
/// (mimalloc added 30 MiB).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, a C string it reads before `main` (`_RJEM_MALLOC_CONF` in the
/// environment overrides them): one arena per CPU instead of four per CPU bound to threads, so
/// that what the loading threads freed is reused by the tokio workers running on those CPUs.
/// With 1,000 sagas alive that is 7 MiB less peak RSS (BENCHMARKS.md, item 19).
#[cfg(feature = "jemalloc")]
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 20] = b"percpu_arena:percpu\0";

fn main() -> std::process::ExitCode {
    cli::main()
}
