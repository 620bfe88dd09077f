//! Replays the committed inputs of the `store_ops` fuzz target once: each
//! a sequence of operations, restarts, `kill -9`s and flipped bytes against
//! a real store, checked against the model (fuzz/src/store_ops.rs). Alone
//! in its test binary, as the kill -9 lives fork.

#[test]
fn store_ops() {
    let target = kvtier_fuzz::target("store_ops").expect("the store_ops target");
    match kvtier_fuzz::replay_committed(target) {
        Ok((corpus, crashes)) => println!("store_ops: {corpus} corpus inputs and {crashes} crash inputs replayed"),
        Err(failed) => panic!("store_ops failed on: {failed:#?}"),
    }
}
