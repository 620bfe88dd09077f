//! Credentials and region from the AWS SDK's default chain (`aws-config`),
//! wrapped as an `object_store` credential provider.
//!
//! The chain is the one every AWS tool follows: the `AWS_*` environment
//! variables; the profile (`AWS_PROFILE`, default `default`) in
//! `~/.aws/credentials` and `~/.aws/config` (`AWS_SHARED_CREDENTIALS_FILE`,
//! `AWS_CONFIG_FILE`) with static keys, `credential_process`, SSO,
//! `role_arn` with `source_profile` or `credential_source`, and web
//! identity; then a web identity token file (EKS), the container role
//! (ECS) and the instance role (IMDS). Temporary credentials are fetched
//! again before they expire ([`REFRESH_BEFORE`]), so a session token is
//! never used past its expiry.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_config::BehaviorVersion;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider};
use object_store::aws::AwsCredential;
use object_store::CredentialProvider;

/// Credentials that expire within this are fetched again. The SDK's own
/// clients refresh 10 s ahead; a minute leaves room for an upload that
/// signs at its start and retries for up to `--s3-upload-timeout-ms`.
pub const REFRESH_BEFORE: Duration = Duration::from_secs(60);

/// What the default chain gives at start: a credentials provider (none when
/// no source is configured, e.g. `AWS_EC2_METADATA_DISABLED` and nothing
/// else) and the region, if any source names one.
pub(crate) struct Chain {
    pub credentials: Option<SdkCredentials>,
    pub region: Option<String>,
}

/// Loads the default chain's configuration (reads the profile files; asks
/// no service: credentials are fetched at the first request).
pub(crate) fn load(runtime: &tokio::runtime::Runtime) -> Chain {
    let config = runtime.block_on(aws_config::defaults(BehaviorVersion::latest()).load());
    Chain { credentials: config.credentials_provider().map(SdkCredentials::new), region: config.region().map(|r| r.as_ref().to_string()) }
}

/// The SDK chain as an `object_store` credential provider: credentials
/// cached until [`REFRESH_BEFORE`] their expiry (static ones for good).
#[derive(Debug)]
pub(crate) struct SdkCredentials {
    provider: SharedCredentialsProvider,
    cached: tokio::sync::Mutex<Option<(Arc<AwsCredential>, Option<SystemTime>)>>,
}

impl SdkCredentials {
    fn new(provider: SharedCredentialsProvider) -> SdkCredentials {
        SdkCredentials { provider, cached: tokio::sync::Mutex::new(None) }
    }
}

/// Whether credentials expiring at `expiry` are still good at `now`.
fn fresh(expiry: Option<SystemTime>, now: SystemTime) -> bool {
    expiry.is_none_or(|e| e.duration_since(now).is_ok_and(|left| left > REFRESH_BEFORE))
}

#[async_trait::async_trait]
impl CredentialProvider for SdkCredentials {
    type Credential = AwsCredential;

    /// The cached credentials, or new ones from the chain (one fetch at a
    /// time: concurrent requests wait for it).
    ///
    /// # Errors
    /// The chain found no credentials or its source failed (a request
    /// signed with nothing would fail anyway); the message names the source.
    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        let mut cached = self.cached.lock().await;
        if let Some((credential, expiry)) = cached.as_ref() {
            if fresh(*expiry, SystemTime::now()) {
                return Ok(credential.clone());
            }
        }
        let got = self
            .provider
            .provide_credentials()
            .await
            .map_err(|e| object_store::Error::Generic { store: "S3", source: format!("AWS credentials: {e}").into() })?;
        let credential = Arc::new(AwsCredential {
            key_id: got.access_key_id().to_string(),
            secret_key: got.secret_access_key().to_string(),
            token: got.session_token().map(str::to_string),
        });
        *cached = Some((credential.clone(), got.expiry()));
        Ok(credential)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_fetched_again_a_minute_before_they_expire() {
        let now = SystemTime::now();
        assert!(fresh(None, now), "static credentials never expire");
        assert!(fresh(Some(now + Duration::from_secs(3600)), now));
        assert!(!fresh(Some(now + Duration::from_secs(30)), now), "within REFRESH_BEFORE");
        assert!(!fresh(Some(now - Duration::from_secs(1)), now), "expired");
    }
}
