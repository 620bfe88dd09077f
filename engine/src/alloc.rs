//! The global allocator every kvtier binary runs on: jemalloc with
//! transparent huge pages, installed by [`jemalloc_with_huge_pages!`].
//!
//! One definition serves `kvtier serve`, `kvtier-loadgen` and the engine
//! bench, so the bench pays the buffer costs the server pays and the
//! loadgen's receive buffers cost what a lean client's would.

/// jemalloc, re-exported for [`jemalloc_with_huge_pages!`].
pub use tikv_jemallocator::Jemalloc;

/// jemalloc's options as a C string: `thp:always`, i.e.
/// `madvise(MADV_HUGEPAGE)` on every mapping jemalloc makes.
///
/// Why (measured here, docs/BENCHMARKS.md):
/// - **Server:** glommio takes its DMA buffers (its registered `io_memory`
///   and the heap past it) from the global allocator. In 2 MiB huge pages
///   they are physically contiguous, so a 1 MiB chunk read is one virtio
///   request instead of two (a request takes at most 254 segments,
///   `/sys/block/*/queue/max_segments`) and adjacent reads merge: the average
///   request grew from ~0.9 to ~3 MiB and 16 MiB GETs from NVMe at
///   concurrency 16 went from 1.2 to 1.5 GB/s ("Huge pages for DMA buffers").
/// - **Loadgen:** a 16 MiB body arrives into freshly allocated buffers. On
///   glibc's allocator every one was faulted in, zeroed and given back
///   (page faults were 40 % of the loadgen's CPU), and h2c GETs read 1.3×
///   slower than on jemalloc; huge pages cut its system time by a further
///   ~15 % at concurrency 16 ("The loadgen's allocator").
///
/// With the kernel's THP mode at `never` the madvise is a no-op.
/// `_RJEM_MALLOC_CONF=thp:default` in the environment overrides it.
pub const MALLOC_CONF: &[u8; 11] = b"thp:always\0";

/// Installs jemalloc as the global allocator with [`MALLOC_CONF`]: use once,
/// at the root of a binary crate. It defines the `#[global_allocator]` and
/// exports `_rjem_malloc_conf` (jemalloc's `malloc_conf` under the prefix
/// tikv-jemallocator builds it with), which jemalloc reads before `main`.
#[macro_export]
macro_rules! jemalloc_with_huge_pages {
    () => {
        #[global_allocator]
        static GLOBAL: $crate::alloc::Jemalloc = $crate::alloc::Jemalloc;

        /// jemalloc's `malloc_conf`: see `kvtier_engine::alloc::MALLOC_CONF`.
        #[allow(non_upper_case_globals)]
        #[export_name = "_rjem_malloc_conf"]
        static malloc_conf: &[u8; 11] = $crate::alloc::MALLOC_CONF;
    };
}
