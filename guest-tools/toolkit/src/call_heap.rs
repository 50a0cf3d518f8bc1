//! A heap for plugins that live for one call.
//!
//! sagabox gives every call a fresh instance and throws it away afterwards, so a plugin's
//! heap starts empty and never has to be tidied: what a general allocator spends on
//! splitting, coalescing and bookkeeping buys nothing. `CallHeap` hands out small blocks
//! by size class (powers of two from 16 bytes to 32 KiB), each class a free list that
//! reuses what was freed, the rest carved from chunks it takes from the system allocator
//! (without WASI, from the initial memory's free part first). Blocks of more than 32 KiB, or
//! aligned to more than 16 bytes, go to the system allocator directly. A loop that allocates
//! and frees reuses the same blocks, so a long call's footprint follows what it holds, not
//! all it ever allocated.
//!
//! Blocks it did not carve (the system allocator's) are passed back to the system allocator:
//! with WASI, the canonical ABI's `cabi_realloc` allocates with the system allocator (see
//! [`cabi_realloc`]), because wasi-libc frees what it receives through it with `free`, while
//! Rust code frees the strings and lists a call receives with this heap.
//!
//! [`export_plugin!`](crate::export_plugin) makes it the global allocator of a plugin
//! component, and exports [`cabi_realloc`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr;

/// The smallest block: 16 bytes, the strictest alignment served from the classes.
const MIN_SHIFT: u32 = 4;
/// The largest block served from the classes: 32 KiB.
const MAX_SHIFT: u32 = 15;
const CLASSES: usize = (MAX_SHIFT - MIN_SHIFT + 1) as usize;
const BLOCK_ALIGN: usize = 1 << MIN_SHIFT;
/// The first chunk taken from the system allocator; later ones double, up to `MAX_CHUNK`.
/// Small, because wasi-libc's allocator writes a header just past each chunk it hands out:
/// past a large first chunk, that is a page a call allocating little would not touch.
const FIRST_CHUNK: usize = 2 << 10;
const MAX_CHUNK: usize = 1 << 20;
/// Chunks a heap keeps track of (adjacent ones count once); past them, blocks come from the
/// system allocator.
const MAX_CHUNKS: usize = 64;

/// The size class of `layout`, or `None` when the system allocator serves it.
fn class_of(layout: Layout) -> Option<usize> {
    if layout.align() > BLOCK_ALIGN || layout.size() > 1 << MAX_SHIFT {
        return None;
    }
    let size = layout.size().max(BLOCK_ALIGN);
    let shift = usize::BITS - (size - 1).leading_zeros();
    Some((shift - MIN_SHIFT) as usize)
}

/// The allocator's state; `CallHeap` wraps it for a single-threaded guest.
pub struct Heap {
    /// Each class's freed blocks, linked through their first word.
    free: [*mut u8; CLASSES],
    /// The chunks taken, as address ranges (adjacent ones as one); the last is the current
    /// one, of which `next..end` is unused.
    chunks: [(usize, usize); MAX_CHUNKS],
    chunk_count: usize,
    next: usize,
    end: usize,
    /// The size of the last chunk taken, 0 before the first.
    chunk: usize,
}

impl Default for Heap {
    fn default() -> Self {
        Self::new()
    }
}

impl Heap {
    pub const fn new() -> Self {
        // All zeros, so that a plugin's heap lies in its zeroed data (`.bss`): writing it then
        // takes a page no call shares, instead of copying a page of the plugin's image.
        Heap {
            free: [ptr::null_mut(); CLASSES],
            chunks: [(0, 0); MAX_CHUNKS],
            chunk_count: 0,
            next: 0,
            end: 0,
            chunk: 0,
        }
    }

    /// # Safety
    /// As [`GlobalAlloc::alloc`].
    pub unsafe fn alloc(&mut self, layout: Layout) -> *mut u8 {
        let Some(class) = class_of(layout) else {
            return unsafe { system::alloc(layout) };
        };
        let head = self.free[class];
        if !head.is_null() {
            // SAFETY: a freed block of this class; its first word links the next one.
            self.free[class] = unsafe { head.cast::<*mut u8>().read() };
            return head;
        }
        let size = BLOCK_ALIGN << class;
        if self.end - self.next < size && !self.refill(size) {
            return unsafe { system::alloc(layout) };
        }
        let block = self.next;
        self.next += size;
        block as *mut u8
    }

    /// # Safety
    /// As [`GlobalAlloc::dealloc`].
    pub unsafe fn dealloc(&mut self, block: *mut u8, layout: Layout) {
        match class_of(layout).filter(|_| self.owns(block)) {
            // The newest block: give its room back to the chunk, so that short-lived
            // blocks freed in turn leave no holes.
            Some(class) if self.is_newest(block, class) => self.next = block as usize,
            Some(class) => {
                // SAFETY: the block is at least 16 bytes and 16-aligned, and now unused.
                unsafe { block.cast::<*mut u8>().write(self.free[class]) };
                self.free[class] = block;
            }
            None => unsafe { system::dealloc(block, layout) },
        }
    }

    /// # Safety
    /// As [`GlobalAlloc::realloc`].
    pub unsafe fn realloc(&mut self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `realloc`'s contract: the new size, rounded up to the alignment, fits isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if !self.owns(block) {
            return unsafe { system::realloc(block, layout, new_size) };
        }
        match (class_of(layout), class_of(new_layout)) {
            // The block already has room (growing a string or a vector within its class).
            (Some(old), Some(new)) if old == new => block,
            // The newest block grows where it is when the chunk has room: a string or a
            // vector being filled takes no copies and leaves no smaller blocks behind.
            (Some(old), Some(new))
                if new > old && self.is_newest(block, old) && block as usize + (BLOCK_ALIGN << new) <= self.end =>
            {
                self.next = block as usize + (BLOCK_ALIGN << new);
                block
            }
            _ => unsafe {
                let moved = self.alloc(new_layout);
                if !moved.is_null() {
                    ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                    self.dealloc(block, layout);
                }
                moved
            },
        }
    }

    /// Whether `block` was carved from one of this heap's chunks (the newest first: most
    /// blocks freed are recent).
    fn owns(&self, block: *mut u8) -> bool {
        let at = block as usize;
        self.chunks[..self.chunk_count].iter().rev().any(|&(start, end)| (start..end).contains(&at))
    }

    /// Whether `block` of `class` is the last one carved from the current chunk (one that
    /// ends where another chunk starts is not).
    fn is_newest(&self, block: *mut u8, class: usize) -> bool {
        let start = self.chunk_count.checked_sub(1).map_or(usize::MAX, |i| self.chunks[i].0);
        block as usize >= start && block as usize + (BLOCK_ALIGN << class) == self.next
    }

    /// Takes a new chunk with room for at least `size` bytes; the rest of the old one is
    /// left unused, unless the new one follows it ([`Heap::add_chunk`]).
    #[cold]
    #[inline(never)]
    fn refill(&mut self, size: usize) -> bool {
        if self.chunk_count == MAX_CHUNKS {
            return false;
        }
        let want = (self.chunk * 2).clamp(FIRST_CHUNK, MAX_CHUNK).max(size);
        let Some((chunk, len)) = take_chunk(size, want) else {
            return false;
        };
        self.add_chunk(chunk as usize, len);
        // The size asked for, not the one given: a short last piece of the initial memory
        // must not restart the doubling from its length.
        self.chunk = want;
        true
    }

    /// Makes `start..start + len` the room blocks are carved from. A chunk that starts where
    /// the current one ends (the initial memory's free part is handed out in order) extends
    /// it: the current chunk's unused end is not left behind, and [`Heap::owns`] has one
    /// range to check instead of one a chunk.
    fn add_chunk(&mut self, start: usize, len: usize) {
        if self.chunk_count > 0 && start == self.end {
            self.end += len;
            self.chunks[self.chunk_count - 1].1 = self.end;
            return;
        }
        self.next = start;
        self.end = start + len;
        self.chunks[self.chunk_count] = (self.next, self.end);
        self.chunk_count += 1;
    }
}

/// The system allocator, kept out of line: inlined into the heap's own paths, its code took
/// registers that every call of `alloc` and `dealloc` then saved and restored.
mod system {
    use std::alloc::{GlobalAlloc, Layout, System};

    /// # Safety
    /// As [`GlobalAlloc::alloc`].
    #[cold]
    #[inline(never)]
    pub unsafe fn alloc(layout: Layout) -> *mut u8 {
        unsafe { System.alloc(layout) }
    }

    /// # Safety
    /// As [`GlobalAlloc::dealloc`].
    #[cold]
    #[inline(never)]
    pub unsafe fn dealloc(block: *mut u8, layout: Layout) {
        unsafe { System.dealloc(block, layout) }
    }

    /// # Safety
    /// As [`GlobalAlloc::realloc`].
    #[cold]
    #[inline(never)]
    pub unsafe fn realloc(block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        unsafe { System.realloc(block, layout, new_size) }
    }
}

/// A chunk aligned to [`BLOCK_ALIGN`] and its length: `want` bytes, or fewer but at least
/// `need` when that is what the initial memory's free part has left (its last piece is used
/// before the memory grows); `None` when the system allocator has no memory either.
fn take_chunk(need: usize, want: usize) -> Option<(*mut u8, usize)> {
    if let Some(spare) = platform::spare_initial_memory(need, want) {
        return Some(spare);
    }
    // SAFETY: `want` is non-zero and a multiple of the alignment.
    let chunk = unsafe { System.alloc(Layout::from_size_align_unchecked(want, BLOCK_ALIGN)) };
    (!chunk.is_null()).then_some((chunk, want))
}

/// Where a chunk of `want` bytes, or of what is left when that is fewer but at least `need`,
/// starts in the free range `start..end`, and its length (a multiple of [`BLOCK_ALIGN`], as
/// `need` and `want` are); `None` when less than `need` is left.
#[cfg(any(test, all(target_arch = "wasm32", target_os = "unknown")))]
fn carve(start: usize, end: usize, need: usize, want: usize) -> Option<(usize, usize)> {
    let start = start.next_multiple_of(BLOCK_ALIGN);
    let left = end.saturating_sub(start) / BLOCK_ALIGN * BLOCK_ALIGN;
    (left >= need).then_some((start, want.min(left)))
}

/// Plugins built without WASI (`wasm32-unknown-unknown`, which the bundled tools are: README,
/// "Rust"). There, Rust's system allocator takes all its memory with `memory.grow` and never
/// uses the free part of the initial memory (wasi-libc's `malloc` does), so every call would
/// grow its memory, and resetting a grown memory's pooled slot costs two `mprotect`s and a
/// TLB shoot-down on every core.
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
mod platform {
    use super::carve;
    use std::alloc::Layout;
    use std::sync::atomic::{AtomicUsize, Ordering};

    unsafe extern "C" {
        /// Where the linker put the end of the stack and the data: the initial memory's free
        /// part starts here.
        static __heap_base: u8;
        /// The end of the initial memory. Past it lies what the system allocator grew, which
        /// is its own.
        static __heap_end: u8;
    }

    /// The start of the initial memory's part not yet handed out; 0 before the first chunk.
    /// (An instance serves one call on one thread: relaxed loads and stores suffice.)
    static SPARE: AtomicUsize = AtomicUsize::new(0);

    /// `want` bytes of the initial memory's free part, or all that is left of it when that
    /// is fewer but at least `need`; `None` when less than `need` is left.
    pub fn spare_initial_memory(need: usize, want: usize) -> Option<(*mut u8, usize)> {
        let mut start = SPARE.load(Ordering::Relaxed);
        if start == 0 {
            start = (&raw const __heap_base) as usize;
        }
        let (start, len) = carve(start, (&raw const __heap_end) as usize, need, want)?;
        SPARE.store(start + len, Ordering::Relaxed);
        Some((start as *mut u8, len))
    }

    /// Nothing frees with `free` here: the canonical ABI's blocks come from the call's heap
    /// (the global allocator).
    ///
    /// # Safety
    /// As [`super::cabi_realloc`], with `new_size` non-zero.
    pub unsafe fn abi_realloc(block: *mut u8, old: Layout, new_size: usize) -> *mut u8 {
        unsafe {
            if old.size() == 0 {
                std::alloc::alloc(Layout::from_size_align_unchecked(new_size, old.align()))
            } else {
                std::alloc::realloc(block, old, new_size)
            }
        }
    }
}

#[cfg(not(all(target_arch = "wasm32", target_os = "unknown")))]
mod platform {
    use std::alloc::{GlobalAlloc, Layout, System};

    /// With WASI (or natively) the system allocator already uses the initial memory.
    pub fn spare_initial_memory(_need: usize, _want: usize) -> Option<(*mut u8, usize)> {
        None
    }

    /// wasi-libc frees what it receives through the canonical ABI (the environment) with
    /// `free`: its blocks come from the system allocator.
    ///
    /// # Safety
    /// As [`super::cabi_realloc`], with `new_size` non-zero.
    pub unsafe fn abi_realloc(block: *mut u8, old: Layout, new_size: usize) -> *mut u8 {
        unsafe {
            if old.size() == 0 {
                System.alloc(Layout::from_size_align_unchecked(new_size, old.align()))
            } else {
                System.realloc(block, old, new_size)
            }
        }
    }
}

/// The canonical ABI's allocator (`cabi_realloc`). The host puts a call's arguments and
/// imports' results in memory it returns, and Rust code frees them with the global
/// allocator, which passes blocks it did not carve on to the system allocator. With WASI it
/// is the system allocator, since wasi-libc frees what it receives (the environment) with
/// `free`; without WASI nothing does, and the call's heap serves it.
///
/// # Safety
/// As the canonical ABI's `realloc`: `block` is null with `old_size` 0, or a block it
/// returned of `old_size` bytes aligned to `align`, a power of two.
pub unsafe fn cabi_realloc(block: *mut u8, old_size: usize, align: usize, new_size: usize) -> *mut u8 {
    if new_size == 0 {
        // A zero-sized value needs no memory, only an aligned address.
        return align as *mut u8;
    }
    // SAFETY: the caller's contract; `new_size` is non-zero.
    let moved = unsafe { platform::abi_realloc(block, Layout::from_size_align_unchecked(old_size, align), new_size) };
    if moved.is_null() {
        // Address 0 would be a valid place to write for the host: stop instead.
        std::process::abort();
    }
    moved
}

/// [`Heap`] as a global allocator. It exists only for WebAssembly without threads, where a
/// guest has one thread (a component instance: sagabox calls each instance once).
#[cfg(all(target_family = "wasm", not(target_feature = "atomics")))]
mod global {
    use super::Heap;
    use std::alloc::{GlobalAlloc, Layout};
    use std::cell::UnsafeCell;

    pub struct CallHeap(UnsafeCell<Heap>);

    // SAFETY: one thread, so no two calls into the allocator can overlap.
    unsafe impl Sync for CallHeap {}

    impl CallHeap {
        pub const fn new() -> Self {
            CallHeap(UnsafeCell::new(Heap::new()))
        }
    }

    impl Default for CallHeap {
        fn default() -> Self {
            Self::new()
        }
    }

    unsafe impl GlobalAlloc for CallHeap {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            unsafe { (*self.0.get()).alloc(layout) }
        }

        unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
            unsafe { (*self.0.get()).dealloc(block, layout) }
        }

        unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            unsafe { (*self.0.get()).realloc(block, layout, new_size) }
        }
    }
}

#[cfg(all(target_family = "wasm", not(target_feature = "atomics")))]
pub use global::CallHeap;

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn sizes_fall_in_the_smallest_class_that_holds_them() {
        assert_eq!(class_of(layout(1, 1)), Some(0));
        assert_eq!(class_of(layout(16, 8)), Some(0));
        assert_eq!(class_of(layout(17, 8)), Some(1));
        assert_eq!(class_of(layout(32 << 10, 16)), Some(CLASSES - 1));
        assert_eq!(class_of(layout((32 << 10) + 1, 1)), None);
        assert_eq!(class_of(layout(8, 32)), None);
    }

    #[test]
    fn a_freed_block_is_reused_and_live_blocks_never_overlap() {
        let mut heap = Heap::new();
        unsafe {
            let mut live: Vec<(*mut u8, Layout)> = Vec::new();
            for i in 0..2000usize {
                let l = layout(1 + (i * 37) % 5000, [1, 8, 16][i % 3]);
                let p = heap.alloc(l);
                assert!(!p.is_null() && (p as usize).is_multiple_of(l.align()));
                p.write_bytes(i as u8, l.size());
                live.push((p, l));
                if i % 3 == 0 {
                    let (q, m) = live.swap_remove(i % live.len());
                    heap.dealloc(q, m);
                }
            }
            // Every live block still holds what was written into it.
            let mut spans: Vec<(usize, usize)> = live.iter().map(|(p, l)| (*p as usize, l.size())).collect();
            spans.sort();
            for pair in spans.windows(2) {
                assert!(pair[0].0 + pair[0].1 <= pair[1].0, "blocks overlap");
            }
            let (p, l) = live.pop().unwrap();
            heap.dealloc(p, l);
            assert_eq!(heap.alloc(l), p, "the block just freed serves the next request of its class");
            let after = heap.alloc(l);
            heap.dealloc(p, l);
            assert_eq!(heap.alloc(l), p, "a block freed below the newest one is reused");
            heap.dealloc(after, l);
            assert_eq!(heap.next, after as usize, "the newest block's room went back to the chunk");
            for (p, l) in live {
                heap.dealloc(p, l);
            }
        }
    }

    #[test]
    fn realloc_keeps_the_contents_and_grows_in_place_within_a_class() {
        let mut heap = Heap::new();
        unsafe {
            let small = heap.alloc(layout(20, 1));
            small.copy_from(b"twenty bytes of text".as_ptr(), 20);
            assert_eq!(heap.realloc(small, layout(20, 1), 30), small, "20 and 30 bytes share a class");
            let moved = heap.realloc(small, layout(30, 1), 100_000);
            assert_eq!(std::slice::from_raw_parts(moved, 20), b"twenty bytes of text");
            let back = heap.realloc(moved, layout(100_000, 1), 40);
            assert_eq!(std::slice::from_raw_parts(back, 20), b"twenty bytes of text");
            heap.dealloc(back, layout(40, 1));
        }
    }

    #[test]
    fn the_newest_block_grows_and_shrinks_in_place() {
        let mut heap = Heap::new();
        unsafe {
            let below = heap.alloc(layout(16, 1));
            let top = heap.alloc(layout(16, 1));
            top.copy_from(b"sixteen bytes!!!".as_ptr(), 16);
            assert_eq!(heap.realloc(top, layout(16, 1), 500), top, "the newest block grew where it was");
            assert_eq!(heap.next, top as usize + 512);
            assert_eq!(std::slice::from_raw_parts(top, 16), b"sixteen bytes!!!");
            let moved = heap.realloc(below, layout(16, 1), 500);
            assert_ne!(moved, below, "a block below the newest one moves to grow");
            heap.dealloc(moved, layout(500, 1));
            heap.dealloc(top, layout(500, 1));
            assert_eq!(heap.next, top as usize, "freeing the newest block gave its room back");
        }
    }

    #[test]
    fn blocks_of_the_system_allocator_go_back_to_it() {
        let mut heap = Heap::new();
        unsafe {
            let ours = heap.alloc(layout(24, 8));
            // What the host's arguments arrive in: the system allocator's, freed by Rust code.
            let given = cabi_realloc(ptr::null_mut(), 0, 1, 24);
            assert!(!heap.owns(given) && heap.owns(ours));
            let grown = heap.realloc(given, layout(24, 1), 48);
            assert!(!heap.owns(grown), "a system block grows with the system allocator");
            heap.dealloc(grown, layout(48, 1));
            assert!(heap.free.iter().all(|f| f.is_null()), "a system block is not kept for reuse");
            heap.dealloc(ours, layout(24, 8));
            assert_eq!(heap.alloc(layout(24, 8)), ours);
        }
    }

    #[test]
    fn past_its_last_chunk_the_heap_serves_from_the_system() {
        let mut heap = Heap::new();
        heap.chunk_count = MAX_CHUNKS;
        unsafe {
            let block = heap.alloc(layout(100, 8));
            assert!(!block.is_null() && !heap.owns(block));
            heap.dealloc(block, layout(100, 8));
            assert!(heap.free.iter().all(|f| f.is_null()), "a system block is not kept");
        }
    }

    #[test]
    fn a_chunk_that_starts_where_the_current_one_ends_extends_it() {
        let mut heap = Heap::new();
        let mut memory = vec![0u128; 1024];
        let start = memory.as_mut_ptr() as usize;
        heap.add_chunk(start, 2048);
        unsafe {
            let first = heap.alloc(layout(1024, 16));
            let second = heap.alloc(layout(512, 16));
            // 512 bytes are left, too few for 1,024: the next chunk follows the first.
            heap.add_chunk(start + 2048, 4096);
            assert_eq!(heap.chunk_count, 1, "one range for both");
            assert_eq!(heap.alloc(layout(1024, 16)) as usize, second as usize + 512, "the first chunk's end was used");
            assert!(heap.owns(first) && heap.owns((start + 6000) as *mut u8) && !heap.owns((start + 6144) as *mut u8));
            // A chunk elsewhere starts a range of its own.
            heap.add_chunk(start + 8192, 4096);
            assert_eq!((heap.chunk_count, heap.next), (2, start + 8192));
            assert!(heap.owns(first) && heap.owns((start + 8192) as *mut u8) && !heap.owns((start + 7000) as *mut u8));
        }
    }

    #[test]
    fn a_new_heap_is_all_zeros_so_it_lies_in_zeroed_data() {
        let heap = Heap::new();
        // SAFETY: `Heap` is pointers and integers, without padding.
        let bytes = unsafe { std::slice::from_raw_parts((&raw const heap).cast::<u8>(), size_of::<Heap>()) };
        assert!(bytes.iter().all(|b| *b == 0));
    }

    #[test]
    fn the_free_parts_last_piece_is_handed_out_when_it_holds_the_block() {
        // 1,010 bytes free from an unaligned start: 1,002 from the 16-aligned 0x1010, of
        // which 992 in whole blocks.
        let (start, end) = (0x1008, 0x1008 + 1010);
        assert_eq!(carve(start, end, 64, 512), Some((0x1010, 512)), "the whole chunk fits");
        assert_eq!(carve(start, end, 64, 4096), Some((0x1010, 992)), "what is left, rounded down");
        assert_eq!(carve(start, end, 992, 4096), Some((0x1010, 992)), "exactly the block asked for");
        assert_eq!(carve(start, end, 1008, 4096), None, "less than the block asked for is left");
        assert_eq!(carve(end, end, 16, 16), None, "nothing is left");
        assert_eq!(carve(end + 16, end, 16, 16), None, "a start past the end leaves nothing");
    }

    #[test]
    fn large_and_overaligned_blocks_come_from_the_system() {
        let mut heap = Heap::new();
        unsafe {
            let big = heap.alloc(layout(1 << 20, 8));
            let aligned = heap.alloc(layout(64, 64));
            assert_eq!(aligned as usize % 64, 0);
            assert_eq!(heap.chunk_count, 0, "no chunk was taken for them");
            heap.dealloc(big, layout(1 << 20, 8));
            heap.dealloc(aligned, layout(64, 64));
        }
    }
}
