//! Byte comparison for plugins.
//!
//! Every `==` and `cmp` on strings and byte slices ends in `memcmp`. The one a WebAssembly
//! plugin links otherwise compares a byte at a time (compiler-builtins' without WASI,
//! wasi-libc's with it): about 140 machine instructions a call in the bundled tools, whose
//! keys, ids and field names are 10-40 bytes long, and 3 % of all a sandboxed CT1 saga
//! executes. [`export_plugin!`](crate::export_plugin) links [`compare`] as the plugin's
//! `memcmp` instead; it reads eight bytes at a time.

/// Compares `n` bytes at `a` with `n` bytes at `b` as C's `memcmp` does: 0 when they are
/// equal, otherwise the first differing byte of `a` less that of `b`, both unsigned.
///
/// # Safety
/// `a` and `b` are valid for reads of `n` bytes.
pub unsafe fn compare(a: *const u8, b: *const u8, n: usize) -> i32 {
    // Unequal strings mostly differ in their first byte (a scan comparing a key with every
    // other): answer those before reading words.
    // SAFETY: `0 < n`.
    if n > 0 && unsafe { *a != *b } {
        return unsafe { i32::from(*a) - i32::from(*b) };
    }
    let mut at = 0;
    while n - at >= 8 {
        // SAFETY: `at + 8 <= n`.
        let (x, y) = unsafe { (word(a.add(at)), word(b.add(at))) };
        if x != y {
            // Read little-endian, the first byte that differs holds the lowest differing bit.
            at += ((x ^ y).trailing_zeros() / 8) as usize;
            break;
        }
        at += 8;
    }
    while at < n {
        // SAFETY: `at < n`.
        let (x, y) = unsafe { (*a.add(at), *b.add(at)) };
        if x != y {
            return i32::from(x) - i32::from(y);
        }
        at += 1;
    }
    0
}

/// The eight bytes at `p`, little-endian, from any alignment.
///
/// # Safety
/// `p` is valid for reads of eight bytes.
unsafe fn word(p: *const u8) -> u64 {
    u64::from_le_bytes(unsafe { p.cast::<[u8; 8]>().read_unaligned() })
}

#[cfg(test)]
mod tests {
    use super::compare;
    use proptest::prelude::*;

    fn sign(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
        assert_eq!(a.len(), b.len());
        // SAFETY: both slices hold `a.len()` bytes.
        unsafe { compare(a.as_ptr(), b.as_ptr(), a.len()) }.cmp(&0)
    }

    #[test]
    fn the_first_differing_byte_decides_taken_unsigned() {
        assert_eq!(unsafe { compare(b"".as_ptr(), b"".as_ptr(), 0) }, 0);
        assert_eq!(
            unsafe { compare(b"abcdefghij".as_ptr(), b"abcdefghiz".as_ptr(), 10) },
            i32::from(b'j') - i32::from(b'z')
        );
        // The difference is in the first word, behind a later byte that differs the other way.
        assert_eq!(unsafe { compare(b"a\x01zzzzzzzz".as_ptr(), b"a\x02aaaaaaaa".as_ptr(), 10) }, -1);
        // 0x80 is above 0x7f as unsigned bytes, as in C.
        assert_eq!(unsafe { compare([0x80u8; 9].as_ptr(), [0x7fu8; 9].as_ptr(), 9) }, 1);
        // Only `n` bytes are compared.
        assert_eq!(unsafe { compare(b"same prefix, then x".as_ptr(), b"same prefix, then y".as_ptr(), 18) }, 0);
    }

    proptest! {
        /// Any lengths and alignments: equal slices compare equal, and unequal ones order as
        /// Rust orders byte slices.
        #[test]
        fn compare_orders_as_byte_slices_do(
            a in proptest::collection::vec(any::<u8>(), 0..80),
            change in any::<Option<(prop::sample::Index, u8)>>(),
            shift_a in 0usize..8,
            shift_b in 0usize..8,
        ) {
            let mut b = a.clone();
            if let Some((i, byte)) = change.filter(|_| !a.is_empty()) {
                b[i.index(a.len())] = byte;
            }
            // Copies at every offset from an aligned start: the words read are unaligned.
            let place = |bytes: &[u8], shift: usize| {
                let mut buffer = vec![0u8; shift];
                buffer.extend_from_slice(bytes);
                buffer
            };
            let (pa, pb) = (place(&a, shift_a), place(&b, shift_b));
            prop_assert_eq!(sign(&pa[shift_a..], &pb[shift_b..]), a.cmp(&b));
            prop_assert_eq!(sign(&pb[shift_b..], &pa[shift_a..]), b.cmp(&a));
        }
    }
}
