//! Placement, capacity, identity and adding devices ([`super`]).

use super::*;

fn spec(s: &str) -> DeviceSpec {
    s.parse().unwrap()
}

#[test]
fn adding_devices_moves_the_shards_whose_devices_change_and_only_those() {
    let layout = |n: u32, devices_before: usize| Layout {
        store_id: Some("x".into()),
        devices: (0..n)
            .map(|i| Device { index: i, dir: format!("/d{i}").into(), capacity_bytes: 90, fs_id: "?".into(), absent: None })
            .collect(),
        replaced: vec![],
        devices_before,
    };
    // 4 shards over 2 devices, then 3: s mod 2 against s mod 3.
    let moved = layout(3, 2).moved_shards(4);
    assert_eq!(moved, vec![(2, vec![PathBuf::from("/d0/shard-002")]), (3, vec![PathBuf::from("/d1/shard-003")])]);
    // 1 shard over 2 devices, then 3: every segment's lane changes.
    assert_eq!(layout(3, 2).moved_shards(1), vec![(0, vec![PathBuf::from("/d0/shard-000"), PathBuf::from("/d1/shard-000")])]);
    // 2 shards over 3 devices, then 4: shard 0 keeps {0, 2}, shard 1 gains 3.
    assert_eq!(layout(4, 3).moved_shards(2), vec![(1, vec![PathBuf::from("/d1/shard-001")])]);
    assert!(layout(2, 2).moved_shards(4).is_empty(), "nothing added, nothing moved");
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
        devices_before: 3,
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
        devices_before: 3,
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
