//! `kvtier._native`: the Python package's binding of `kvtier-client`
//! (PyO3; built by maturin from `clients/python/pyproject.toml`). Python
//! keeps the connection and its state; the hot loops run here, with the GIL
//! released while they run.

use std::os::fd::BorrowedFd;

mod conn;

use kvtier_client::{SharedIndex, Table, BAD_KEY};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

/// The index tables of one server process's shards, mapped read-only
/// (docs/LOCAL.md, "The shared index").
///
/// ``IndexTables(tables)``: ``tables`` is, per shard in order, ``(fd,
/// file_bytes, buckets)`` as ``MAP_INDEX`` answered; each is mapped (the
/// descriptors may be closed afterwards) and its header checked.
///
/// Raises:
///     ValueError: a table is not a version-1 index table of ``buckets``
///         buckets, is shorter than ``file_bytes``, or is not the shard of
///         its place.
///     OSError: ``mmap`` failed.
#[pyclass(module = "kvtier._native", frozen)]
struct IndexTables {
    index: SharedIndex,
}

#[pymethods]
impl IndexTables {
    #[new]
    fn new(tables: Vec<(i32, u64, u32)>) -> PyResult<IndexTables> {
        let mut mapped = Vec::with_capacity(tables.len());
        for (fd, file_bytes, buckets) in tables {
            if fd < 0 {
                return Err(PyValueError::new_err(format!("bad descriptor {fd}")));
            }
            // SAFETY: the caller's open descriptor, only borrowed for the map.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let table = Table::map(fd, file_bytes).map_err(index_error)?;
            if table.reader().buckets() != buckets {
                let mapped_buckets = table.reader().buckets();
                return Err(PyValueError::new_err(format!("index table of {mapped_buckets} buckets, MAP_INDEX said {buckets}")));
            }
            mapped.push(table);
        }
        let index = SharedIndex::new(mapped).map_err(index_error)?;
        Ok(IndexTables { index })
    }

    /// Shards (tables).
    #[getter]
    fn shards(&self) -> usize {
        self.index.shards()
    }

    /// Whether a table overflowed (it no longer lists every block).
    fn overflowed(&self) -> bool {
        self.index.overflowed()
    }

    /// Per key the wire number of the fastest local tier listed for it (1
    /// gpu, 2 ram, 3 nvme; 0 none; ``BAD_KEY`` (255) for a key the server would refuse,
    /// or not a ``str``: not probed), as ``bytes``; ``None`` when the index
    /// cannot answer for all of them (a table overflowed, a bucket stayed
    /// busy): then ask the server.
    fn tiers<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyList>) -> Option<Bound<'py, PyBytes>> {
        self.probe(py, keys).map(|out| PyBytes::new(py, &out))
    }

    /// ``batch_is_exist``'s answer from the index: per key 1 (a local tier
    /// lists it), 0 (none does), -1 (a key the server would refuse, or not
    /// a ``str``); ``None`` as for :meth:`tiers`.
    fn exist(&self, py: Python<'_>, keys: &Bound<'_, PyList>) -> Option<Vec<i8>> {
        let out = self.probe(py, keys)?;
        Some(out.into_iter().map(|t| if t == BAD_KEY { -1 } else { (t != 0) as i8 }).collect())
    }
}

impl IndexTables {
    /// [`SharedIndex::tiers`] of `keys` with the GIL released; a key that
    /// is not a `str` answers [`BAD_KEY`].
    fn probe(&self, py: Python<'_>, keys: &Bound<'_, PyList>) -> Option<Vec<u8>> {
        // Each item is held (a reference of our own), so its UTF-8 bytes stay
        // valid while the GIL is released, whatever another thread does to
        // the list. A key that is not a str is probed as the empty key,
        // which the rule refuses.
        let items: Vec<Bound<'_, PyAny>> = keys.iter().collect();
        let bytes: Vec<&[u8]> =
            items.iter().map(|k| k.cast::<PyString>().ok().and_then(|s| s.to_str().ok()).map_or(&b""[..], str::as_bytes)).collect();
        let mut out = Vec::with_capacity(bytes.len());
        py.detach(|| self.index.tiers(bytes.iter().copied(), &mut out)).then_some(out)
    }
}

fn index_error(e: kvtier_client::IndexError) -> PyErr {
    match e {
        kvtier_client::IndexError::Map(io) => PyOSError::new_err(format!("mapping an index table: {io}")),
        other => PyValueError::new_err(other.to_string()),
    }
}

/// Whether the generation at address ``generation`` (a slot's u64 in a
/// mapped arena's generation table) still equals ``leased``, read after an
/// acquire fence: call it after reading the block; ``False`` means the bytes
/// read are not to be trusted (docs/LOCAL.md, "Leases").
#[pyfunction]
fn still_leased(generation: usize, leased: u64) -> bool {
    // SAFETY: the caller (kvtier.memory.leases) passes an address inside an
    // arena it keeps mapped while its lease views live.
    unsafe { kvtier_client::lease::still_leased(generation as *const u64, leased) }
}

/// Copies ``nbytes`` from a leased block at address ``src`` into ``dst``
/// (the caller's writable memory) with the GIL released, then checks the
/// generation as :func:`still_leased`: ``True`` when ``dst`` holds the block.
#[pyfunction]
fn copy_leased(py: Python<'_>, dst: usize, src: usize, nbytes: usize, generation: usize, leased: u64) -> bool {
    // SAFETY: kvtier.memory.leases passes a block inside an arena it keeps
    // mapped (under its lock, while the view lives) and a destination it
    // checked writable and at least nbytes long.
    py.detach(|| unsafe { kvtier_client::lease::copy_leased(dst as *mut u8, src as *const u8, nbytes, generation as *const u64, leased) })
}

/// kvtier's native core (module docs).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<IndexTables>()?;
    m.add_class::<conn::Connection>()?;
    m.add_class::<conn::Ticket>()?;
    m.add_function(wrap_pyfunction!(still_leased, m)?)?;
    m.add_function(wrap_pyfunction!(copy_leased, m)?)?;
    m.add("BAD_KEY", BAD_KEY)?;
    wire_constants(m)
}

/// The wire's constants, from `kvtier-local-proto` (the server's own), so
/// Python writes none of them again.
fn wire_constants(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use kvtier_local_proto as p;
    for op in p::Op::ALL {
        m.add(format!("OP_{}", op.name()).as_str(), op as u8)?;
    }
    m.add("OP_NAMES", p::Op::ALL.iter().map(|op| (*op as u8, op.name())).collect::<std::collections::HashMap<_, _>>())?;
    m.add("OP_ERROR", p::OP_CONNECTION_ERROR)?;
    m.add("RESPONSE", p::RESPONSE_BIT)?;
    m.add("MAGIC", p::MAGIC)?;
    m.add("HEADER_BYTES", p::HEADER_BYTES)?;
    m.add("MAX_ITEMS", p::ITEMS_MAX)?;
    m.add("MAX_PARTS", p::PARTS_MAX)?;
    m.add("MAX_PAYLOAD_BYTES", p::PAYLOAD_BYTES_MAX)?;
    m.add("MAX_IN_FLIGHT", kvtier_client::IN_FLIGHT_MAX)?;
    m.add("VERSIONS", p::VERSIONS.to_vec())?;
    m.add("VERSION_TAGS", p::VERSION_TAGS)?;
    m.add("VERSION_LEASES", p::VERSION_LEASES)?;
    m.add("ITEM_BYTES", kvtier_client::ops::ITEM_BYTES)?;
    m.add("PART_BYTES", kvtier_client::ops::PART_BYTES)?;
    m.add("CLOSE_CONFIRM_S", kvtier_client::CLOSE_CONFIRM.as_secs_f64())?;
    m.add("CLIENT_NAME", conn::CLIENT_NAME)?;
    // Every code by name: the server's (local-proto), OK, and the client's own two.
    let mut codes: std::collections::HashMap<&str, i64> = p::Code::ALL.iter().map(|c| (p::Code::name_of(*c as i64), *c as i64)).collect();
    codes.insert("OK", 0);
    codes.insert("NOT_REGISTERED", kvtier_client::NOT_REGISTERED);
    codes.insert("CONNECTION_LOST", kvtier_client::CONNECTION_LOST);
    m.add("CODES", codes)?;
    // Tier numbers on the wire → names (0, "none", is not stored: left out).
    m.add("TIER_NAMES", p::TIER_NAMES.iter().enumerate().skip(1).map(|(i, n)| (i as u8, *n)).collect::<std::collections::HashMap<_, _>>())?;
    Ok(())
}
