//! The `kvtier` binary's pieces: [`args`] (the command line), [`serve`]
//! (`kvtier serve`: compose and run), [`listen`] (the listening socket),
//! [`inspect`] (`kvtier info`, `kvtier fsck`).

pub mod args;
pub mod inspect;
pub mod listen;
pub mod serve;
