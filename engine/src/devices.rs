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
//! **Adding devices** ([`Layout::resolve_adding`], `kvtier serve
//! --add-devices`). Directories given past a store's devices become new
//! devices, numbered after the last; keys stay on their shards, so only
//! placement changes: a shard whose devices differ under the new count
//! ([`Layout::moved_shards`]; with S ≥ D, those with `s mod D ≠ s mod D'`)
//! drops its segments where it was and starts empty where it is placed
//! now, and the others keep theirs. The drops are done before any
//! `store.json` names the longer device list, so a start that stops midway
//! is finished by the next, which takes the longest list it finds.
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
    /// Devices the store had before this start: fewer than `devices` when
    /// devices were added on it ([`Layout::resolve_adding`]).
    pub devices_before: usize,
}

impl Layout {
    /// One directory, as a store was before devices: `dir` holding
    /// `capacity_bytes` (used by tests and tools that make a store in one place).
    pub fn single(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Layout {
        let dir = dir.into();
        let fs_id = fs_id(&dir);
        Layout {
            store_id: None,
            devices: vec![Device { index: 0, dir, capacity_bytes, fs_id, absent: None }],
            replaced: Vec::new(),
            devices_before: 1,
        }
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

    /// The shards whose devices changed because devices were added on this
    /// start, each with its directories on the devices it spanned before
    /// (`shard-NNN` on each): their segments there are discarded, and they
    /// start empty on the devices they span now.
    pub fn moved_shards(&self, shards: usize) -> Vec<(usize, Vec<PathBuf>)> {
        if self.devices_before >= self.devices.len() {
            return Vec::new();
        }
        (0..shards)
            .filter_map(|s| {
                let before = devices_of_shard(s, shards, self.devices_before);
                (before != devices_of_shard(s, shards, self.devices.len()))
                    .then(|| (s, before.into_iter().map(|d| self.devices[d].dir.join(format!("shard-{s:03}"))).collect()))
            })
            .collect()
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
        Self::resolve_adding(specs, disk_bytes, shards, false)
    }

    /// [`Layout::resolve`], and with `add` the directories given past an
    /// existing store's devices become new devices (`kvtier serve
    /// --add-devices`), numbered after the last: each must be an empty
    /// directory (or not yet exist) and give its size (`PATH=SIZE_GB`), and
    /// every device the store has must be present. Keys stay on their
    /// shards; the shards whose devices change ([`Layout::moved_shards`])
    /// lose the segments on the devices they leave (module docs).
    ///
    /// # Errors
    /// As [`Layout::resolve`], and [`Error::Config`] for an added directory
    /// without a size or holding files, or a device of the store absent.
    pub fn resolve_adding(specs: &[DeviceSpec], disk_bytes: u64, shards: usize, add: bool) -> Result<Layout> {
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
        let (first, _) = &found[0];
        // The longest device list: an add that stopped before it rewrote
        // every device's store.json left the older, shorter one on some.
        let template = &found.iter().max_by_key(|(i, m)| (m.devices.len(), std::cmp::Reverse(*i))).expect("found is not empty").1;
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
        if specs.len() > records.len() && !add {
            return Err(Error::Config(format!(
                "{} data directories given, but store {id} has {} devices: to add the other {} as new devices, start once with --add-devices (docs/OPERATIONS.md, \"Adding a device\": shards placed anew start empty)",
                specs.len(),
                records.len(),
                specs.len() - records.len()
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
        let added: Vec<usize> =
            if specs.len() > records.len() { Self::check_added(specs, &fresh, &found, records.len(), &id)? } else { Vec::new() };
        let mut fresh = fresh.into_iter().filter(|i| !added.contains(i));
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
        let devices_before = records.len();
        for (n, i) in added.iter().enumerate() {
            let spec = &specs[*i];
            devices.push(Device {
                index: (devices_before + n) as u32,
                dir: spec.dir.clone(),
                capacity_bytes: spec.capacity_bytes.expect("checked above"),
                fs_id: fs_id(&spec.dir),
                absent: None,
            });
        }
        Ok(Layout { store_id: Some(id), devices, replaced, devices_before })
    }

    /// The directories of `fresh` (those holding no `store.json`) that
    /// become new devices when `specs` gives more than the store's
    /// `devices`: as many as are past them, each checked to be addable.
    fn check_added(
        specs: &[DeviceSpec],
        fresh: &[usize],
        found: &[(usize, StoreManifest)],
        devices: usize,
        id: &str,
    ) -> Result<Vec<usize>> {
        let adding = specs.len() - devices;
        if found.len() != devices || fresh.len() != adding {
            return Err(Error::Config(format!(
                "devices can be added only with every device of store {id} present: {} of its {devices} directories were found among the {} given",
                found.len(),
                specs.len()
            )));
        }
        for &i in fresh {
            let spec = &specs[i];
            if spec.capacity_bytes.is_none() {
                return Err(Error::Config(format!(
                    "{} is added as a device: give its size, --data-dir {}=SIZE_GB (a store's devices were sized when it was made)",
                    spec.dir.display(),
                    spec.dir.display()
                )));
            }
            match std::fs::read_dir(&spec.dir) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::Config(format!("{} cannot be added as a device: listing it: {e}", spec.dir.display()))),
                Ok(entries) => {
                    let held: Vec<String> = entries
                        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                        .filter(|n| n != "lost+found")
                        .take(3)
                        .collect();
                    if !held.is_empty() {
                        return Err(Error::Config(format!(
                            "{} holds files ({}…) and no store.json: a device is added as an empty directory",
                            spec.dir.display(),
                            held.join(", ")
                        )));
                    }
                }
            }
        }
        Ok(fresh.to_vec())
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
        Ok(Layout { store_id: Some(new_store_id()?), devices, replaced: Vec::new(), devices_before: specs.len() })
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
mod tests;
