//! Replays every committed fuzz input of the decoder and front-door
//! targets once (`kvtier_fuzz::replay_committed`): the seed corpora and
//! every input that ever made a target fail, through the same functions
//! libFuzzer runs (docs/TESTING.md). `store_ops` has a test binary of its
//! own (tests/store_ops.rs): it forks, which is safe only in a process
//! whose other threads hold no locks.

fn replay(name: &str) {
    let target = kvtier_fuzz::target(name).expect("a target of that name");
    match kvtier_fuzz::replay_committed(target) {
        Ok((corpus, crashes)) => println!("{name}: {corpus} corpus inputs and {crashes} crash inputs replayed"),
        Err(failed) => panic!("{name} failed on: {failed:#?}"),
    }
}

macro_rules! replay_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                replay(stringify!($name));
            }
        )*

        #[test]
        fn every_target_has_a_replay_test() {
            let tested = [$(stringify!($name)),*, "store_ops"];
            for t in kvtier_fuzz::TARGETS {
                assert!(tested.contains(&t.name), "target {} has no replay test", t.name);
            }
        }
    };
}

replay_tests!(slot_header, slot, index_snapshot, store_json, s3_object, key, key_list, http_route, local_frames, tenants_file);
