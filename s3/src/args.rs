//! The shared-tier flags of `kvtier serve` and their checks.

use std::time::Duration;

use serde::Serialize;

/// `--s3-write-policy` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum S3WritePolicy {
    /// Acknowledge the PUT once stored locally; upload afterwards from a
    /// bounded queue per shard (dropped and counted when full).
    Behind,
    /// Acknowledge the PUT after the upload too (or after it failed or
    /// timed out: S3 never fails a PUT).
    Through,
    /// Never upload; still read from the shared tier.
    Off,
}

/// The shared-tier flags of `kvtier serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct S3Args {
    /// Shared tier below NVMe: s3://BUCKET[/PREFIX]. Credentials and region
    /// come from the AWS SDK's default chain: the AWS_* environment
    /// variables, then the profile (AWS_PROFILE) in ~/.aws/credentials and
    /// ~/.aws/config (static keys, credential_process, SSO, role_arn, web
    /// identity), then the container or instance role; temporary
    /// credentials are refreshed before they expire. Unset: no shared tier.
    #[arg(long)]
    pub s3_url: Option<String>,
    /// Endpoint of a non-AWS S3-compatible store (MinIO, Ceph RGW, Garage,
    /// GCS, moto), e.g. http://127.0.0.1:9000; path-style requests. Default:
    /// AWS_ENDPOINT_URL, else AWS.
    #[arg(long, requires = "s3_url")]
    pub s3_endpoint: Option<String>,
    /// behind: a PUT is acknowledged when stored locally, and uploaded
    /// afterwards from a bounded queue per shard (dropped and counted when
    /// full). through: acknowledged after the upload as well (a failed or
    /// timed-out upload is counted, never fails the PUT). off: never
    /// upload; reads still fall through to S3.
    #[arg(long, value_enum, default_value_t = S3WritePolicy::Behind, requires = "s3_url")]
    pub s3_write_policy: S3WritePolicy,
    /// An S3 read, existence check or delete that takes longer than this is
    /// abandoned and answered as a miss (counted as a timeout), in ms.
    #[arg(long, default_value_t = 2000, requires = "s3_url")]
    pub s3_timeout_ms: u64,
    /// An upload that takes longer than this is abandoned and counted as
    /// failed, in ms.
    #[arg(long, default_value_t = 30_000, requires = "s3_url")]
    pub s3_upload_timeout_ms: u64,
    /// Block bytes each shard's write-behind queue holds, in MiB (at least
    /// one block). A PUT whose upload would not fit is still acknowledged;
    /// its upload is dropped and counted.
    #[arg(long, default_value_t = 256, requires = "s3_url")]
    pub s3_upload_queue_mib: u64,
    /// Uploads in flight per shard.
    #[arg(long, default_value_t = 4, requires = "s3_url")]
    pub s3_uploads_inflight: usize,
    /// Existence checks in flight at once for one lookup's tail, and
    /// objects fetched at once for one prefetch.
    #[arg(long, default_value_t = 16, requires = "s3_url")]
    pub s3_lookup_parallelism: usize,
    /// How long a shard remembers that a key is present or absent in the
    /// bucket, in ms (0: never), so a prefix lookup does not cost a round
    /// trip per block each time.
    #[arg(long, default_value_t = 5000, requires = "s3_url")]
    pub s3_presence_ttl_ms: u64,
    /// Threads of the tokio runtime that runs the S3 client.
    #[arg(long, default_value_t = 2, requires = "s3_url")]
    pub s3_threads: usize,
}

impl S3WritePolicy {
    /// `behind`, `through` or `off`.
    pub fn as_str(&self) -> &'static str {
        match self {
            S3WritePolicy::Behind => "behind",
            S3WritePolicy::Through => "through",
            S3WritePolicy::Off => "off",
        }
    }
}

/// The flags, checked: what [`crate::S3Tier`] runs with.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub location: crate::object::S3Location,
    pub url: String,
    pub endpoint: Option<String>,
    pub policy: S3WritePolicy,
    pub timeout: Duration,
    pub upload_timeout: Duration,
    pub parallelism: usize,
    pub presence_ttl: Duration,
    pub queue_blocks: usize,
    pub uploads_inflight_max: usize,
    pub threads: usize,
}

impl S3Args {
    /// Checks the flags for blocks of `block_bytes`.
    ///
    /// # Errors
    /// The flag and what is wrong with its value.
    pub(crate) fn settings(&self, block_bytes: u64) -> Result<Settings, String> {
        let url = self.s3_url.as_deref().ok_or("--s3-url is not set")?;
        let location = crate::object::parse_url(url)?;
        for (flag, v) in [("--s3-timeout-ms", self.s3_timeout_ms), ("--s3-upload-timeout-ms", self.s3_upload_timeout_ms)] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        for (flag, v) in [
            ("--s3-uploads-inflight", self.s3_uploads_inflight),
            ("--s3-lookup-parallelism", self.s3_lookup_parallelism),
            ("--s3-threads", self.s3_threads),
        ] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if self.s3_upload_queue_mib == 0 {
            return Err("--s3-upload-queue-mib must be at least 1".into());
        }
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let endpoint = self.s3_endpoint.clone().or_else(|| env("AWS_ENDPOINT_URL_S3")).or_else(|| env("AWS_ENDPOINT_URL"));
        if let Some(e) = &endpoint {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(format!("the S3 endpoint {e:?} (--s3-endpoint, AWS_ENDPOINT_URL) must be an http:// or https:// URL"));
            }
        }
        Ok(Settings {
            location,
            url: url.to_string(),
            endpoint,
            policy: self.s3_write_policy,
            timeout: Duration::from_millis(self.s3_timeout_ms),
            upload_timeout: Duration::from_millis(self.s3_upload_timeout_ms),
            parallelism: self.s3_lookup_parallelism,
            presence_ttl: Duration::from_millis(self.s3_presence_ttl_ms),
            queue_blocks: ((self.s3_upload_queue_mib << 20) / block_bytes.max(1)).max(1) as usize,
            uploads_inflight_max: self.s3_uploads_inflight,
            threads: self.s3_threads,
        })
    }
}
