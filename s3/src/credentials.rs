//! Credentials and region from the shared AWS files.
//!
//! `object_store`'s builder reads the `AWS_*` environment variables and the
//! instance or container role; it does not read `~/.aws/credentials` or
//! `~/.aws/config`, which most operators use. This reads the static keys
//! and the region of the selected profile from them.

use std::collections::HashMap;
use std::path::PathBuf;

/// Credentials from the shared credentials file.
pub(crate) struct SharedCredentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

fn home_file(env_var: &str, default: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(default))
}

/// The `[section]` of an INI-style AWS file as key → value.
fn ini_section(text: &str, section: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            continue;
        }
        if inside {
            if let Some((k, v)) = line.split_once('=') {
                out.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
    }
    out
}

fn profile() -> String {
    std::env::var("AWS_PROFILE").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "default".into())
}

/// `aws_access_key_id`, `aws_secret_access_key` and `aws_session_token` of
/// the profile `AWS_PROFILE` (default `default`) in
/// `AWS_SHARED_CREDENTIALS_FILE` (default `~/.aws/credentials`).
pub(crate) fn shared_credentials() -> Option<SharedCredentials> {
    let text = std::fs::read_to_string(home_file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials")?).ok()?;
    let s = ini_section(&text, &profile());
    Some(SharedCredentials {
        access_key_id: s.get("aws_access_key_id")?.clone(),
        secret_access_key: s.get("aws_secret_access_key")?.clone(),
        session_token: s.get("aws_session_token").cloned(),
    })
}

/// `region` of the profile in `AWS_CONFIG_FILE` (default `~/.aws/config`;
/// section `[default]` or `[profile NAME]`).
pub(crate) fn shared_config_region() -> Option<String> {
    let text = std::fs::read_to_string(home_file("AWS_CONFIG_FILE", ".aws/config")?).ok()?;
    let p = profile();
    let section = if p == "default" { p } else { format!("profile {p}") };
    ini_section(&text, &section).get("region").cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_files_are_read_by_profile() {
        let text = "[default]\naws_access_key_id = AK\naws_secret_access_key=SK\n\n[profile other]\nregion = eu-west-1\n[other]\nAWS_ACCESS_KEY_ID=OK\n";
        let d = ini_section(text, "default");
        assert_eq!((d["aws_access_key_id"].as_str(), d["aws_secret_access_key"].as_str()), ("AK", "SK"));
        assert_eq!(ini_section(text, "profile other")["region"], "eu-west-1");
        assert_eq!(ini_section(text, "other")["aws_access_key_id"], "OK");
        assert!(ini_section(text, "missing").is_empty());
    }
}
