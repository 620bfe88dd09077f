//! Several data directories per store, one per device (NVMe drive):
//! which shard's log lives on which device, how much of each device a
//! store takes, and how the directories of a store are recognised.
//!
//! **Placement** ([`devices_of_shard`]). A store of `S` shards over `D`
//! devices puts shard `s`'s log (`shard-NNN/`) on device `s mod D` when
//! `S ≥ D`, so the shards are spread evenly (each device gets `S / D` of
//! them, the first `S mod D` one more). With fewer shards than devices,
//! shard `s` spans the devices `d` with `d mod S = s`, and its segments
//! rotate over them: segment `i` lives on the `i mod k`-th of its `k`
//! devices (new segments are made in id order, so writes go round them),
//! each holding an equal number of its segments. Either way a block is
//! never striped across devices: it lives in one slot of one segment. Keys
//! are routed to shards as with one directory (`block_hash mod shards`), so
//! adding devices never moves a key between shards.
//!
//! A shard that spans several devices depends on all of them: one absent
//! at start leaves the shard without a log for that run, one failing at run
//! time refuses the shard's writes (its segments on the other devices still
//! serve), and one replaced by an empty directory discards the shard's
//! segments on the others too (`ShardConfig::discard_log`): a newer
//! version or a tombstone lost with the device must not leave an older
//! version on another to be served.
//!
//! **Capacity.** Each device holds `capacity_bytes` of segments, split
//! evenly among its shards (a shard spanning several devices takes as many
//! segments from each as the smallest holds): given per directory as `PATH=SIZE_GB`, else
//! `--disk-gb` split in proportion to each filesystem's free space when the
//! store is made, and recorded in `store.json`. With one directory the
//! capacity is `--disk-gb` at every start, as before devices existed.
//!
//! **Identity.** Every directory holds its own `store.json` naming the
//! store (`store_id`, 128 random bits made with the store), the whole
//! device list (index, filesystem id, capacity, shards) and which device it
//! is (`device_index`). Directories are matched by that, not by their order
//! on the command line; a directory of another store is refused naming
//! both; an empty directory given for a device that is not there takes its
//! place, and its shards start empty. A store made before devices (one
//! directory, no `store_id`) opens as it always did.
//!
//! **A device absent at start.** A device whose directory is not given,
//! does not exist, cannot be read (an I/O error: a dead drive), or is an
//! empty directory that cannot be that device's filesystem (see
//! [`Layout::resolve`]) is *absent*: the store starts without it, its
//! shards serve what the RAM and S3 tiers hold with their log down, and
//! nothing is made or written where its directory would be. A restart with
//! the device's directory brings their logs back as they were.
//!
//! The functions here read and stat directories with `std::fs`: they run
//! at start-up and in `kvtier fsck`/`info`, never on a shard's thread.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::{Error, Result};
pub use crate::geometry::DeviceRecord;
use crate::geometry::StoreManifest;

mod dirs;
mod stats;

use dirs::{capacities, check_replacement, new_store_id, same_dir, Replacement};
pub use dirs::{free_bytes, fs_id};
pub use stats::{device_stats, DeviceStats};

/// One `--data-dir` as given: a directory and, optionally, how many bytes
/// of segments it may hold (`PATH=SIZE_GB`).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSpec {
    /// The data directory on this device.
    pub dir: PathBuf,
    /// Its capacity for segments, bytes (`None`: from `--disk-gb`).
    pub capacity_bytes: Option<u64>,
}

impl FromStr for DeviceSpec {
    type Err = String;

    /// `PATH` or `PATH=SIZE_GB` (GiB, 2^30 bytes; a positive number). A path
    /// that itself holds `=` is taken whole unless what follows the last
    /// `=` is a number.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s.is_empty() {
            return Err("a data directory cannot be empty".into());
        }
        if let Some((path, size)) = s.rsplit_once('=') {
            if let Ok(gb) = size.parse::<f64>() {
                if !(gb.is_finite() && gb > 0.0) || path.is_empty() {
                    return Err(format!("{s:?}: the size after '=' must be a positive number of GiB, with a path before it"));
                }
                return Ok(DeviceSpec { dir: PathBuf::from(path), capacity_bytes: Some((gb * (1u64 << 30) as f64) as u64) });
            }
        }
        Ok(DeviceSpec { dir: PathBuf::from(s), capacity_bytes: None })
    }
}

/// One device of an open store.
#[derive(Debug, Clone, PartialEq)]
pub struct Device {
    /// Its index in the store's device list.
    pub index: u32,
    /// Its data directory (as given on this start).
    pub dir: PathBuf,
    /// Bytes of segments it holds.
    pub capacity_bytes: u64,
    /// The filesystem id of its directory now (hex); an absent device's as
    /// recorded when the store was made.
    pub fs_id: String,
    /// Why the device is absent on this start (its directory not given,
    /// missing or unreadable): its shards run without a log. `None`: present.
    pub absent: Option<String>,
}

/// The devices of a store, by index, as matched on this start.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// The store's id; `None` for a store made before devices (one directory).
    pub store_id: Option<String>,
    /// Every device, by index.
    pub devices: Vec<Device>,
    /// Devices given as empty directories in place of missing ones: their shards start empty.
    pub replaced: Vec<u32>,
}

impl Layout {
    /// One directory, as a store was before devices: `dir` holding
    /// `capacity_bytes` (used by tests and tools that make a store in one place).
    pub fn single(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Layout {
        let dir = dir.into();
        let fs_id = fs_id(&dir);
        Layout { store_id: None, devices: vec![Device { index: 0, dir, capacity_bytes, fs_id, absent: None }], replaced: Vec::new() }
    }

    /// The devices absent on this start (module docs).
    pub fn absent(&self) -> impl Iterator<Item = &Device> {
        self.devices.iter().filter(|d| d.absent.is_some())
    }

    /// The device that holds shard `shard`'s log, or with fewer shards than
    /// devices the first of those it spans (its home: its index snapshot).
    pub fn device_of(&self, shard: usize) -> &Device {
        &self.devices[shard % self.devices.len()]
    }

    /// The devices shard `shard` of `shards` spans, in the order its
    /// segments rotate over them ([`devices_of_shard`]).
    pub fn devices_of(&self, shard: usize, shards: usize) -> Vec<&Device> {
        devices_of_shard(shard, shards, self.devices.len()).into_iter().map(|d| &self.devices[d]).collect()
    }

    /// The shards on device `index` of a store of `shards` shards.
    pub fn shards_on(&self, index: usize, shards: usize) -> Vec<u32> {
        shards_on_device(index, shards, self.devices.len())
    }

    /// Shard `shard`'s directory on its home device: `<dir>/shard-NNN`.
    pub fn shard_dir(&self, shard: usize) -> PathBuf {
        self.device_of(shard).dir.join(format!("shard-{shard:03}"))
    }

    /// Shard `shard`'s directories, one on each device it spans, in the
    /// order its segments rotate over them (the first is [`Layout::shard_dir`]).
    pub fn shard_dirs(&self, shard: usize, shards: usize) -> Vec<PathBuf> {
        self.devices_of(shard, shards).iter().map(|d| d.dir.join(format!("shard-{shard:03}"))).collect()
    }

    /// Bytes of segments shard `shard` may keep on each device it spans:
    /// a device's capacity over the shards on it, or for a shard spanning
    /// several, the smallest of theirs (each holds an equal share of its
    /// segments).
    pub fn shard_lane_bytes(&self, shard: usize, shards: usize) -> u64 {
        self.devices_of(shard, shards)
            .iter()
            .map(|d| d.capacity_bytes / self.shards_on(d.index as usize, shards).len().max(1) as u64)
            .min()
            .unwrap_or(0)
    }

    /// Bytes of segments shard `shard` may hold in all.
    pub fn shard_capacity_bytes(&self, shard: usize, shards: usize) -> u64 {
        self.shard_lane_bytes(shard, shards) * devices_of_shard(shard, shards, self.devices.len()).len() as u64
    }

    /// Why shard `shard` has no log on this start: the first absent device
    /// it spans, with its reason.
    pub fn shard_absent(&self, shard: usize, shards: usize) -> Option<String> {
        self.devices_of(shard, shards)
            .iter()
            .find_map(|d| d.absent.as_ref().map(|why| format!("device {} is absent since start ({why})", d.index)))
    }

    /// Why shard `shard` must start with an empty log on every device it
    /// spans: one of several it spans was replaced by an empty directory.
    pub fn shard_discards(&self, shard: usize, shards: usize) -> Option<String> {
        let spans = self.devices_of(shard, shards);
        if spans.len() < 2 {
            return None;
        }
        spans.iter().find(|d| self.replaced.contains(&d.index)).map(|d| {
            format!(
                "device {} was replaced by an empty directory, so shard {shard}'s segments on the other devices it spans are discarded (an older version of a block there could otherwise be served)",
                d.index
            )
        })
    }

    /// The device list `store.json` records.
    pub fn records(&self, shards: usize) -> Vec<DeviceRecord> {
        self.devices
            .iter()
            .map(|d| DeviceRecord {
                index: d.index,
                fs_id: d.fs_id.clone(),
                capacity_bytes: d.capacity_bytes,
                shards: self.shards_on(d.index as usize, shards),
            })
            .collect()
    }

    /// Every device's total capacity, bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.devices.iter().map(|d| d.capacity_bytes).sum()
    }

    /// Matches the directories given (`specs`, in any order) to a store's
    /// devices (module docs): a new store when none holds a `store.json`
    /// (each device's capacity its `PATH=SIZE_GB`, else `disk_bytes` alone
    /// for one directory, else `disk_bytes` split by free space); an
    /// existing store's devices by the `store_id` and `device_index` their
    /// directories hold. A device whose directory is not among them takes
    /// the next directory that holds no `store.json`: an empty one stands
    /// in for it (its shards start empty there), and one that does not
    /// exist or cannot be read leaves it absent, as does none left
    /// ([`Device::absent`]; `check_replacement` says when an empty
    /// directory cannot stand in). Reads only: `store.json` files are
    /// written when the store opens.
    ///
    /// # Errors
    /// [`Error::Config`] naming the directories for: a directory given
    /// twice; no shards for a new store; directories of two
    /// stores; a store made with one directory given more; more
    /// directories than the store has devices; a directory holding files
    /// and no `store.json` in place of a device; sizes that do not add up;
    /// no readable directory holding the store while one cannot be read.
    /// [`Error::Config`] for a `store.json` that does not parse.
    pub fn resolve(specs: &[DeviceSpec], disk_bytes: u64, shards: usize) -> Result<Layout> {
        if specs.is_empty() {
            return Err(Error::Config("at least one --data-dir is needed".into()));
        }
        for (i, a) in specs.iter().enumerate() {
            if let Some(b) = specs[..i].iter().find(|b| same_dir(&a.dir, &b.dir)) {
                return Err(Error::Config(format!("--data-dir {} is given twice (also as {})", a.dir.display(), b.dir.display())));
            }
        }
        let mut found: Vec<(usize, StoreManifest)> = Vec::new();
        // Directories whose store.json could not be read (an I/O error):
        // absent devices, if the store turns out to have them.
        let mut unreadable: Vec<(usize, String)> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let path = StoreManifest::path(&spec.dir);
            match std::fs::read(&path) {
                Ok(bytes) => found.push((i, StoreManifest::parse(&bytes).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound || e.kind() == std::io::ErrorKind::NotADirectory => {}
                Err(e) => unreadable.push((i, format!("reading {}: {e}", path.display()))),
            }
        }
        if found.is_empty() {
            if let Some((i, why)) = unreadable.first() {
                return Err(Error::Config(format!(
                    "{} cannot be read ({why}), and no other directory given holds a store: give a readable directory of the store",
                    specs[*i].dir.display()
                )));
            }
            return Self::new_store(specs, disk_bytes, shards);
        }
        if let Some((i, _)) = found.iter().find(|(_, m)| m.store_id.is_none()) {
            if specs.len() > 1 {
                return Err(Error::Config(format!(
                    "{} holds a store made with one data directory; a store's devices are fixed when it is made: give it alone, or make a new store over empty directories",
                    specs[*i].dir.display()
                )));
            }
            let spec = &specs[0];
            return Ok(Layout::single(spec.dir.clone(), spec.capacity_bytes.unwrap_or(disk_bytes)));
        }
        let (first, template) = &found[0];
        let id = template.store_id.clone().expect("checked above");
        for (i, m) in &found[1..] {
            if m.store_id.as_deref() != Some(id.as_str()) {
                return Err(Error::Config(format!(
                    "{} belongs to store {} but {} to store {}: give the directories of one store",
                    specs[*first].dir.display(),
                    id,
                    specs[*i].dir.display(),
                    m.store_id.as_deref().unwrap_or("?")
                )));
            }
        }
        let records = &template.devices;
        if specs.len() > records.len() {
            return Err(Error::Config(format!(
                "{} data directories given, but store {id} has {} devices (made so; its shards' logs are placed by device)",
                specs.len(),
                records.len()
            )));
        }
        let mut by_index: BTreeMap<u32, usize> = BTreeMap::new();
        for (i, m) in &found {
            let index = m.device_index.unwrap_or(u32::MAX);
            if records.iter().all(|r| r.index != index) {
                return Err(Error::Config(format!("{} names device {index}, which store {id} does not have", specs[*i].dir.display())));
            }
            if let Some(other) = by_index.insert(index, *i) {
                return Err(Error::Config(format!(
                    "{} and {} are both device {index} of store {id} (a copy of a directory?)",
                    specs[other].dir.display(),
                    specs[*i].dir.display()
                )));
            }
        }
        let fresh: Vec<usize> = (0..specs.len()).filter(|i| found.iter().all(|(j, _)| j != i)).collect();
        let mut fresh = fresh.into_iter();
        // Filesystems a stand-in for a device of its own cannot be on: the
        // root's (an unmounted drive's mount point lives there) and the
        // present devices'.
        let mut taken_fs: Vec<String> = found.iter().map(|(i, _)| fs_id(&specs[*i].dir)).collect();
        taken_fs.push(fs_id(Path::new("/")));
        let mut replaced = Vec::new();
        let mut devices = Vec::with_capacity(records.len());
        for r in records {
            // One directory: --disk-gb at every start, as before devices;
            // several: what was recorded when the store was made.
            let recorded = if records.len() == 1 { disk_bytes } else { r.capacity_bytes };
            let absent = |dir: PathBuf, why: String| Device {
                index: r.index,
                dir,
                capacity_bytes: recorded,
                fs_id: r.fs_id.clone(),
                absent: Some(why),
            };
            let spec = match by_index.get(&r.index) {
                Some(&i) => &specs[i],
                None => match fresh.next() {
                    Some(i) => {
                        let dir = &specs[i].dir;
                        if let Some((_, why)) = unreadable.iter().find(|(j, _)| *j == i) {
                            devices.push(absent(dir.clone(), why.clone()));
                            continue;
                        }
                        let own_fs = records.iter().all(|o| o.index == r.index || o.fs_id != r.fs_id);
                        match check_replacement(dir, r.index, &id, own_fs.then_some(&taken_fs[..]))? {
                            Replacement::Empty => replaced.push(r.index),
                            Replacement::Absent(why) => {
                                devices.push(absent(dir.clone(), why));
                                continue;
                            }
                        }
                        &specs[i]
                    }
                    None => {
                        devices.push(absent(PathBuf::new(), "its directory is not among the directories given".into()));
                        continue;
                    }
                },
            };
            devices.push(Device {
                index: r.index,
                dir: spec.dir.clone(),
                capacity_bytes: spec.capacity_bytes.unwrap_or(recorded),
                fs_id: fs_id(&spec.dir),
                absent: None,
            });
        }
        Ok(Layout { store_id: Some(id), devices, replaced })
    }

    fn new_store(specs: &[DeviceSpec], disk_bytes: u64, shards: usize) -> Result<Layout> {
        if shards == 0 {
            return Err(Error::Config("a store needs at least 1 shard".into()));
        }
        let capacities = capacities(specs, disk_bytes)?;
        let devices = specs
            .iter()
            .zip(capacities)
            .enumerate()
            .map(|(i, (s, capacity_bytes))| Device {
                index: i as u32,
                dir: s.dir.clone(),
                capacity_bytes,
                fs_id: fs_id(&s.dir),
                absent: None,
            })
            .collect();
        Ok(Layout { store_id: Some(new_store_id()?), devices, replaced: Vec::new() })
    }
}

/// The devices shard `shard` of `shards` spans over `devices` devices, in
/// the order its segments rotate over them: device `shard mod devices`
/// when there are at least as many shards as devices, else every device
/// `d` with `d mod shards = shard` (module docs).
pub fn devices_of_shard(shard: usize, shards: usize, devices: usize) -> Vec<usize> {
    let devices = devices.max(1);
    if shards >= devices {
        vec![shard % devices]
    } else {
        (shard..devices).step_by(shards.max(1)).collect()
    }
}

/// The shards whose logs device `device` holds (all or part of), in a
/// store of `shards` shards over `devices` devices.
pub fn shards_on_device(device: usize, shards: usize, devices: usize) -> Vec<u32> {
    let devices = devices.max(1);
    if shards >= devices {
        (0..shards).filter(|s| s % devices == device).map(|s| s as u32).collect()
    } else {
        vec![(device % shards.max(1)) as u32]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> DeviceSpec {
        s.parse().unwrap()
    }

    #[test]
    fn a_spec_is_a_path_with_an_optional_size() {
        assert_eq!(spec("/a"), DeviceSpec { dir: "/a".into(), capacity_bytes: None });
        assert_eq!(spec("/a=2").capacity_bytes, Some(2 << 30));
        assert_eq!(spec("/a=b").dir, PathBuf::from("/a=b"));
        assert!("/a=0".parse::<DeviceSpec>().unwrap_err().contains("positive"));
        assert!("=3".parse::<DeviceSpec>().is_err());
    }

    #[test]
    fn shards_go_round_robin_and_split_their_devices_capacity() {
        let l = Layout {
            store_id: Some("x".into()),
            devices: (0..3)
                .map(|i| Device { index: i, dir: format!("/d{i}").into(), capacity_bytes: 90, fs_id: "?".into(), absent: None })
                .collect(),
            replaced: vec![],
        };
        assert_eq!(l.shards_on(0, 8), vec![0, 3, 6]);
        assert_eq!(l.shards_on(2, 8), vec![2, 5]);
        assert_eq!(l.shard_dir(4), PathBuf::from("/d1/shard-004"));
        assert_eq!(l.shard_capacity_bytes(0, 8), 30);
        assert_eq!(l.shard_capacity_bytes(2, 8), 45);
        let all: Vec<u32> = l.records(8).iter().flat_map(|r| r.shards.clone()).collect();
        assert_eq!(all.len(), 8);
    }

    #[test]
    fn new_capacities_take_sizes_then_split_the_rest() {
        let d = tempfile::tempdir().unwrap();
        let (a, b, c) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
        let specs = [
            DeviceSpec { dir: a.clone(), capacity_bytes: Some(10) },
            DeviceSpec { dir: b, capacity_bytes: None },
            DeviceSpec { dir: c, capacity_bytes: None },
        ];
        // b and c are on one filesystem: the 90 bytes left split evenly.
        assert_eq!(capacities(&specs, 100).unwrap(), vec![10, 45, 45]);
        assert!(capacities(&specs, 10).unwrap_err().to_string().contains("leaves nothing"));
        assert_eq!(capacities(&[DeviceSpec { dir: a, capacity_bytes: None }], 7).unwrap(), vec![7]);
    }

    #[test]
    fn a_directory_twice_is_refused_and_fewer_shards_than_devices_rotate() {
        let d = tempfile::tempdir().unwrap();
        let specs = [spec(&d.path().join("a").to_string_lossy()), spec(&d.path().join("b").to_string_lossy())];
        let one = Layout::resolve(&specs, 1 << 30, 1).unwrap();
        assert_eq!(one.shard_dirs(0, 1), vec![d.path().join("a/shard-000"), d.path().join("b/shard-000")]);
        let twice = [specs[0].clone(), specs[0].clone()];
        assert!(Layout::resolve(&twice, 1 << 30, 2).unwrap_err().to_string().contains("given twice"));
    }

    #[test]
    fn fewer_shards_than_devices_span_them_with_the_smallest_share_on_each() {
        // 2 shards over 5 devices: shard 0 on 0, 2, 4; shard 1 on 1, 3.
        assert_eq!(devices_of_shard(0, 2, 5), vec![0, 2, 4]);
        assert_eq!(devices_of_shard(1, 2, 5), vec![1, 3]);
        assert_eq!(shards_on_device(4, 2, 5), vec![0]);
        assert_eq!(shards_on_device(3, 2, 5), vec![1]);
        // As many shards as devices or more: round robin, one device each.
        assert_eq!(devices_of_shard(5, 8, 3), vec![2]);
        assert_eq!(shards_on_device(2, 8, 3), vec![2, 5]);
        let l = Layout {
            store_id: Some("x".into()),
            devices: [100, 60, 90]
                .iter()
                .enumerate()
                .map(|(i, c)| Device { index: i as u32, dir: format!("/d{i}").into(), capacity_bytes: *c, fs_id: "?".into(), absent: None })
                .collect(),
            replaced: vec![2],
        };
        assert_eq!(l.shard_lane_bytes(0, 2), 90, "shard 0 takes as much from each of its devices as the smaller holds");
        assert_eq!(l.shard_capacity_bytes(0, 2), 180);
        assert_eq!(l.shard_capacity_bytes(1, 2), 60);
        assert_eq!(l.shard_dir(1), PathBuf::from("/d1/shard-001"));
        assert!(l.shard_discards(0, 2).unwrap().contains("device 2 was replaced"));
        assert_eq!(l.shard_discards(1, 2), None);
        let all: Vec<u32> = l.records(2).iter().flat_map(|r| r.shards.clone()).collect();
        assert_eq!(all, vec![0, 1, 0]);
    }
}
