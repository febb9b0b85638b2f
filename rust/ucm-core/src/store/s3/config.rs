//! Configuration of the S3 store.

use std::fmt;

use crate::config::{ConfigError, Geometry, Values};
use crate::error::{Result, UcmError};

/// The S3 stage's own keys (besides the geometry, `device_id` and
/// `timeout_ms`), declared in `config/keys.toml`.
pub use crate::config::keys::S3 as KEYS;

use crate::store::remote::expand_env;

/// S3 store settings. Field names follow the config keys (`s3_*`).
///
/// `Debug` never prints the secret key or the session token.
#[derive(Clone)]
pub struct S3Config {
    /// `s3://bucket/prefix` (`storage_backends`). The prefix may be empty.
    pub url: String,
    /// Endpoint URL of an S3-compatible service (`s3_endpoint`), e.g.
    /// `http://127.0.0.1:9000`; empty: AWS (or `AWS_ENDPOINT_URL`).
    pub endpoint: String,
    /// Region (`s3_region`); empty: `AWS_REGION`/`AWS_DEFAULT_REGION`, else
    /// `us-east-1`.
    pub region: String,
    /// Access key id (`s3_access_key`); `${VAR}` is expanded. Empty: the
    /// standard AWS environment variables and credential sources.
    pub access_key: String,
    /// Secret access key (`s3_secret_key`); `${VAR}` is expanded.
    pub secret_key: String,
    /// Session token (`s3_session_token`); `${VAR}` is expanded.
    pub session_token: String,
    /// Virtual-hosted-style requests (`s3_virtual_hosted_style`); path style
    /// (the default) is what most S3-compatible servers expect.
    pub virtual_hosted_style: bool,
    /// Requests in flight at most (`s3_max_concurrency`).
    pub max_concurrency: usize,
    /// Retries of a failed request (5xx, connection errors, timeouts of
    /// idempotent requests), with exponential backoff (`s3_retries`).
    pub retries: usize,
    /// Task timeout counted from submit, also the budget of one request with
    /// its retries; 0 = none (requests then time out after 30 s each).
    pub timeout_ms: u64,
    /// How long a "present" lookup result is reused
    /// (`s3_lookup_cache_ttl_ms`); 0 disables.
    pub lookup_cache_ttl_ms: u64,
    /// How long an "absent" lookup result is reused
    /// (`s3_negative_cache_ttl_ms`); 0 disables. Blocks written by other
    /// engines become visible at most this late.
    pub negative_cache_ttl_ms: u64,
    /// Bytes of memory for blocks whose shards are still arriving
    /// (layer-wise dumps); see the module docs.
    pub staging_bytes: u64,
    /// Runtime threads (`s3_io_threads`).
    pub io_threads: usize,
    /// Block, shard and tensor sizes.
    pub geometry: Geometry,
    /// -1: lookup-only role (load and dump refused); >= 0: transfers on.
    pub device_id: i64,
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            url: String::new(),
            endpoint: String::new(),
            region: String::new(),
            access_key: String::new(),
            secret_key: String::new(),
            session_token: String::new(),
            virtual_hosted_style: false,
            max_concurrency: 32,
            retries: 3,
            timeout_ms: 30_000,
            lookup_cache_ttl_ms: 30_000,
            negative_cache_ttl_ms: 1_000,
            staging_bytes: 1 << 30,
            io_threads: 2,
            geometry: Geometry::default(),
            device_id: 0,
        }
    }
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("url", &self.url)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key", &redact(&self.access_key))
            .field("secret_key", &"<redacted>")
            .field("session_token", &"<redacted>")
            .field("max_concurrency", &self.max_concurrency)
            .field("retries", &self.retries)
            .field("timeout_ms", &self.timeout_ms)
            .field("block_size", &self.geometry.block_size)
            .field("shard_size", &self.geometry.shard_size)
            .finish_non_exhaustive()
    }
}

/// An access key id with all but its first four characters hidden.
pub fn redact(key: &str) -> String {
    if key.is_empty() {
        return String::new();
    }
    let head: String = key.chars().take(4).collect();
    format!("{head}...")
}

/// `s3://bucket/prefix` split into its parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Location {
    /// Bucket name.
    pub bucket: String,
    /// Key prefix without leading or trailing '/'; may be empty.
    pub prefix: String,
}

impl S3Location {
    /// Parses `s3://bucket[/prefix]` (also `s3a://`).
    pub fn parse(url: &str) -> Result<Self> {
        let rest = url
            .strip_prefix("s3://")
            .or_else(|| url.strip_prefix("s3a://"))
            .ok_or_else(|| {
                UcmError::invalid(format!(
                    "storage_backends: {url:?} is not an S3 URL; expected s3://bucket/prefix"
                ))
            })?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let valid_bucket = (3..=63).contains(&bucket.len())
            && bucket
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
        if !valid_bucket {
            return Err(UcmError::invalid(format!(
                "storage_backends: {bucket:?} is not a valid bucket name (3-63 characters: \
                 lowercase letters, digits, '-' and '.')"
            )));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|p| p == "." || p == "..")
            || (!prefix.is_empty() && prefix.split('/').any(str::is_empty))
        {
            return Err(UcmError::invalid(format!(
                "storage_backends: key prefix {prefix:?} has an empty, '.' or '..' part"
            )));
        }
        Ok(S3Location {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }
}

impl S3Config {
    /// Builds the config from a checked S3 stage (see [`crate::config`]).
    pub fn from_values(v: &Values) -> std::result::Result<Self, ConfigError> {
        let geometry = Geometry::from_values(v)?;
        let url = v.text("storage_backends").trim().to_string();
        if !(url.starts_with("s3://") || url.starts_with("s3a://") || url.starts_with("${")) {
            return Err(ConfigError::new(
                "storage_backends",
                format!("{url:?} is not an S3 location; expected s3://bucket/prefix"),
            ));
        }
        Ok(S3Config {
            url,
            endpoint: v.text("s3_endpoint").to_string(),
            region: v.text("s3_region").to_string(),
            access_key: v.text("s3_access_key").to_string(),
            secret_key: v.text("s3_secret_key").to_string(),
            session_token: v.text("s3_session_token").to_string(),
            virtual_hosted_style: v.bool("s3_virtual_hosted_style"),
            max_concurrency: v.usize("s3_max_concurrency"),
            retries: v.usize("s3_retries"),
            timeout_ms: v.u64("timeout_ms"),
            lookup_cache_ttl_ms: v.u64("s3_lookup_cache_ttl_ms"),
            negative_cache_ttl_ms: v.u64("s3_negative_cache_ttl_ms"),
            staging_bytes: (v.float("s3_staging_buffer_gb") * (1u64 << 30) as f64) as u64,
            io_threads: v.usize("s3_io_threads"),
            geometry,
            device_id: v.int("device_id"),
        })
    }

    /// Expands `${VAR}` in the credential and endpoint keys.
    pub fn resolved(&self) -> Result<Self> {
        let mut c = self.clone();
        c.url = expand_env("storage_backends", &c.url)?;
        c.endpoint = expand_env("s3_endpoint", &c.endpoint)?;
        c.region = expand_env("s3_region", &c.region)?;
        c.access_key = expand_env("s3_access_key", &c.access_key)?;
        c.secret_key = expand_env("s3_secret_key", &c.secret_key)?;
        c.session_token = expand_env("s3_session_token", &c.session_token)?;
        Ok(c)
    }

    /// Checks sizes and keys; errors name the key and the value (never a
    /// secret).
    pub fn validate(&self) -> Result<S3Location> {
        let loc = S3Location::parse(&self.url)?;
        let scheme_ok =
            self.endpoint.starts_with("http://") || self.endpoint.starts_with("https://");
        if !self.endpoint.is_empty() && !scheme_ok {
            return Err(UcmError::invalid(format!(
                "s3_endpoint: {:?} must start with http:// or https://",
                self.endpoint
            )));
        }
        if self.access_key.is_empty() != self.secret_key.is_empty() {
            return Err(UcmError::invalid(
                "s3_access_key / s3_secret_key: give both or neither (neither: the standard \
                 AWS environment variables and credential sources are used)",
            ));
        }
        self.geometry.validate()?;
        if self.max_concurrency == 0 {
            return Err(UcmError::invalid("s3_max_concurrency: must be > 0"));
        }
        if self.io_threads == 0 {
            return Err(UcmError::invalid("s3_io_threads: must be > 0"));
        }
        Ok(loc)
    }

    /// True when loads and dumps are allowed.
    pub fn transfers_enabled(&self) -> bool {
        self.device_id >= 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_locations() {
        let l = S3Location::parse("s3://kv-bucket/ucm/cache/").unwrap();
        assert_eq!(
            (l.bucket.as_str(), l.prefix.as_str()),
            ("kv-bucket", "ucm/cache")
        );
        assert_eq!(S3Location::parse("s3://kvb").unwrap().prefix, "");
        for bad in [
            "/tmp/x",
            "s3://",
            "s3://UPPER/x",
            "s3://kvb/a//b",
            "s3://kvb/../x",
        ] {
            assert!(S3Location::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn debug_never_shows_secrets() {
        let c = S3Config {
            access_key: "AKIAEXAMPLEKEY".into(),
            secret_key: "very-secret".into(),
            session_token: "token-secret".into(),
            ..Default::default()
        };
        let s = format!("{c:?}");
        assert!(
            !s.contains("very-secret") && !s.contains("token-secret"),
            "{s}"
        );
        assert!(
            !s.contains("AKIAEXAMPLEKEY") && s.contains("AKIA..."),
            "{s}"
        );
    }

    #[test]
    fn validation_names_the_key() {
        let ok = S3Config {
            url: "s3://kvb/p".into(),
            geometry: Geometry {
                block_size: 8192,
                shard_size: 4096,
                tensor_size_list: vec![4096],
            },
            ..Default::default()
        };
        assert!(ok.validate().is_ok());
        let cases = [
            (
                S3Config {
                    access_key: "a".into(),
                    ..ok.clone()
                },
                "s3_secret_key",
            ),
            (
                S3Config {
                    endpoint: "127.0.0.1:9000".into(),
                    ..ok.clone()
                },
                "s3_endpoint",
            ),
            (
                S3Config {
                    geometry: Geometry {
                        tensor_size_list: vec![1],
                        ..ok.geometry.clone()
                    },
                    ..ok
                },
                "tensor_size_list",
            ),
        ];
        for (bad, key) in cases {
            assert!(bad.validate().unwrap_err().to_string().contains(key));
        }
    }
}
