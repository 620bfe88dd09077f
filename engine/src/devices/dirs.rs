//! The directories given as devices, read at start-up (`std::fs`, never on
//! a shard's thread): their filesystems and free space, whether one can
//! stand in for a device that is not there, the split of `--disk-gb` over
//! new ones, and a new store's id.

use std::path::Path;

use super::DeviceSpec;
use crate::error::{Error, Result};

/// What a directory given in place of a device that is not there is.
#[derive(Debug, PartialEq)]
pub(super) enum Replacement {
    /// An empty directory: the device's shards start empty there.
    Empty,
    /// Not the device nor a stand-in for it (why): the device is absent.
    Absent(String),
}

/// A directory given in place of device `index` of store `id`: an existing
/// directory holding nothing (but ext4's `lost+found`) stands in for it, and
/// the device's shards start empty there. One that does not exist or
/// cannot be listed is most often the device itself, not mounted or
/// failed (its directory lived on it): the device is absent, and nothing is
/// made there (making it would put the shards on whatever filesystem holds
/// its parent). Likewise an empty directory on one of `taken_fs` (given
/// when the device had a filesystem of its own: the root's and the present
/// devices'), which is an unmounted drive's mount point or a directory
/// made where the drive should be mounted.
///
/// # Errors
/// [`Error::Config`] for a directory holding files, naming it, the device
/// and what to do.
pub(super) fn check_replacement(dir: &Path, index: u32, id: &str, taken_fs: Option<&[String]>) -> Result<Replacement> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Replacement::Absent(format!(
                "{} does not exist (if it is on that device, mount the device; to start the device's shards empty there, make it an empty directory on a filesystem of its own)",
                dir.display()
            )))
        }
        Err(e) => return Ok(Replacement::Absent(format!("listing {}: {e}", dir.display()))),
    };
    let mut held = Vec::new();
    for entry in entries {
        let name = match entry {
            Ok(entry) => entry.file_name(),
            Err(e) => return Ok(Replacement::Absent(format!("listing {}: {e}", dir.display()))),
        };
        if name != "lost+found" {
            held.push(name.to_string_lossy().into_owned());
        }
    }
    if !held.is_empty() {
        held.sort();
        held.truncate(3);
        return Err(Error::Config(format!(
            "{} holds files ({}…) and no store.json, so it cannot stand in for device {index} of store {id}: give that device's directory, or an empty directory to start its shards empty",
            dir.display(),
            held.join(", ")
        )));
    }
    let here = fs_id(dir);
    if taken_fs.is_some_and(|taken| here != "?" && taken.contains(&here)) {
        return Ok(Replacement::Absent(format!(
            "{} is an empty directory on the root filesystem or another device's (filesystem {here}), while device {index} had a filesystem of its own: most often the drive is not mounted there; mount it, or a new drive for its shards to start empty",
            dir.display()
        )));
    }
    Ok(Replacement::Empty)
}

/// Each new device's capacity: its `PATH=SIZE_GB`; for one directory
/// without a size `disk_bytes`; else what `disk_bytes` leaves after the
/// sized ones, split among the others in proportion to their
/// filesystems' free space (evenly when it cannot be read).
pub(super) fn capacities(specs: &[DeviceSpec], disk_bytes: u64) -> Result<Vec<u64>> {
    if specs.len() == 1 {
        return Ok(vec![specs[0].capacity_bytes.unwrap_or(disk_bytes)]);
    }
    let sized: u64 = specs.iter().filter_map(|s| s.capacity_bytes).sum();
    let open_ended: Vec<&DeviceSpec> = specs.iter().filter(|s| s.capacity_bytes.is_none()).collect();
    if open_ended.is_empty() {
        return Ok(specs.iter().map(|s| s.capacity_bytes.unwrap_or(0)).collect());
    }
    let left = disk_bytes.checked_sub(sized).filter(|&b| b > 0).ok_or_else(|| {
        Error::Config(format!(
            "--disk-gb ({disk_bytes} bytes) leaves nothing for the data directories given without a size after those with one ({sized} bytes): give every directory a size (PATH=SIZE_GB) or raise --disk-gb"
        ))
    })?;
    let free: Vec<u64> = open_ended.iter().map(|s| free_bytes(&s.dir).unwrap_or(0)).collect();
    let total: u128 = free.iter().map(|&f| f as u128).sum();
    let share = |i: usize| -> u64 {
        match (left as u128 * free[i] as u128).checked_div(total) {
            Some(bytes) => bytes as u64,
            None => left / open_ended.len() as u64, // free space unknown: evenly
        }
    };
    let mut next = 0;
    Ok(specs
        .iter()
        .map(|s| {
            s.capacity_bytes.unwrap_or_else(|| {
                next += 1;
                share(next - 1)
            })
        })
        .collect())
}

/// Whether two paths name one directory (by device and inode when both
/// exist, else by their text).
pub(super) fn same_dir(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => a == b,
    }
}

/// `statvfs` of the nearest existing ancestor of `dir` (it may not exist yet).
fn statvfs(dir: &Path) -> Option<libc::statvfs> {
    let mut at = Some(dir);
    while let Some(p) = at {
        if p.exists() {
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
            let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
            // SAFETY: `c` is a NUL-terminated path; `s` is ours to fill.
            return (unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0).then_some(s);
        }
        at = p.parent().filter(|q| !q.as_os_str().is_empty()).or(if p.is_relative() { Some(Path::new(".")) } else { None });
        if at == Some(p) {
            break;
        }
    }
    None
}

/// Bytes free to an unprivileged writer on `dir`'s filesystem.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    statvfs(dir).map(|s| s.f_bavail * s.f_frsize)
}

/// `dir`'s filesystem id (`statvfs`'s `f_fsid`, hex; `?` when unknown):
/// two directories on one filesystem share it.
pub fn fs_id(dir: &Path) -> String {
    statvfs(dir).map_or_else(|| "?".into(), |s| format!("{:016x}", { s.f_fsid }))
}

/// 128 random bits, hex: a new store's id.
pub(super) fn new_store_id() -> Result<String> {
    let mut bytes = [0u8; 16];
    // SAFETY: getrandom fills the buffer we own.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        return Err(Error::io("getrandom for a new store id".to_string(), std::io::Error::last_os_error()));
    }
    Ok(hex::encode(bytes))
}
