//! The S3 store: blocks as objects in an S3-compatible bucket (AWS S3,
//! MinIO, Ceph RGW, ...), shared by engines on many machines.
//!
//! # Object layout
//!
//! One object per block, at `<prefix>/<2 hex>/<32 hex>` (the Posix store's
//! relative paths, so a Posix root synced to a bucket is usable as is), and
//! byte for byte a Posix block file (`codec`): shard `i` is a 4 KiB header
//! plus data at `i * stride`. Loads fetch shards with range GETs (the
//! contiguous shards of one block in one request) and verify the header
//! (block id, shard index, layout fingerprint) and the xxh3 checksum before a
//! byte reaches caller memory.
//!
//! # Visibility and layer-wise dumps
//!
//! A PUT makes an object visible whole or not at all, so readers never see a
//! partial block, as long as each block is written by ONE PUT. Layer-wise
//! dumps deliver a block's shards in separate tasks; the store therefore
//! assembles them in a per-block staging buffer and PUTs the block when its
//! last shard arrives (in whatever order and task they come). Alternatives
//! considered and rejected:
//! * an object per shard plus a commit marker: N+1 PUTs and N GETs per block,
//!   and orphaned shard objects whenever a writer dies mid-block;
//! * a multipart upload with one part per shard: visible only on
//!   CompleteMultipartUpload (atomic, no staging memory), but S3 requires
//!   every part but the last to be at least 5 MiB, and per-layer shards of
//!   KV blocks are usually far smaller; an abandoned upload also costs
//!   storage until a lifecycle rule aborts it.
//!
//! Staging memory is bounded by `staging_bytes` (blocks being uploaded
//! count until their PUT finishes). A new block waits for room until its
//! task's deadline, and blocks whose missing shards never come are dropped
//! after twice `timeout_ms` of inactivity. As in the Posix store, a shard's
//! unit completes when its bytes are staged; the unit that completes a
//! block completes when the PUT did, with its outcome. (Staging and
//! uploads: `remote::staging`.)
//!
//! # Lookups
//!
//! HEAD requests (presence and size: an object of another size is another
//! layout's, not a hit), `s3_max_concurrency` at a time in id order, a
//! prefix lookup stopping at its first miss, and a `shared::LookupCache`
//! of results (positive ones for `s3_lookup_cache_ttl_ms`, negative ones for
//! `s3_negative_cache_ttl_ms`), so repeated prefix lookups of the same ids
//! on every scheduler step cost no round trip. Blocks this store wrote are
//! cached as present.
//!
//! # Failures
//!
//! Requests are retried with exponential backoff (5xx, connection errors,
//! timeouts of idempotent requests; `s3_retries`), each bounded by
//! `timeout_ms`, and every task unit is also cut off at its task's deadline.
//! A transport failure opens a `shared::Breaker`: for a short, growing
//! pause lookups answer "absent" and transfers fail at once, so a dead
//! server means recomputation, not stalls. Wrong credentials, a missing
//! bucket or an unreachable endpoint fail `open` with a message naming the
//! key. Credentials never appear in logs or errors.

pub mod config;
pub mod maintain;

pub use config::{S3Config, S3Location, KEYS};
pub use maintain::S3Maintenance;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
};

use super::remote::staging::{self, RequestCounters, Stager, Uploader};
use super::remote::{RemoteBackend, RemoteCore, RemoteStore};
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::store::format::codec::is_layout_mismatch;
use crate::store::remote::{run_blocking, Breaker, LookupCache, Runtime};

/// The S3 side of an [`S3Store`]: the bucket client, the staging of
/// layer-wise dumps and the uploads in flight.
pub struct S3Backend {
    core: RemoteCore,
    cfg: S3Config,
    loc: S3Location,
    /// `s3://bucket/prefix`, for messages.
    location: String,
    client: Arc<AmazonS3>,
    prefix: ObjPath,
    limiter: tokio::sync::Semaphore,
    stager: Stager,
    /// Requests to the bucket (the shell counts lookups and loads).
    counters: RequestCounters,
}

/// Blocks as objects in an S3-compatible bucket.
pub type S3Store = RemoteStore<S3Backend>;

/// Classifies an object_store error: the core error, and whether it says
/// the server is unreachable or failing (which opens the breaker).
fn map_err(op: &str, what: &str, e: object_store::Error) -> (UcmError, bool) {
    match e {
        object_store::Error::NotFound { .. } => (UcmError::NotFound(what.to_string()), false),
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => (
            UcmError::TaskFailed(format!(
                "S3 {op} {what}: access denied (check s3_access_key / s3_secret_key and the \
                 bucket policy): {e}"
            )),
            false,
        ),
        other => {
            let msg = other.to_string();
            let client_error = msg.contains("status code: 4");
            let timeout = msg.contains("timed out") || msg.contains("Timeout");
            let err = if timeout {
                UcmError::Timeout(format!("S3 {op} {what}: {msg}"))
            } else {
                UcmError::TaskFailed(format!("S3 {op} {what}: {msg}"))
            };
            (err, !client_error)
        }
    }
}

/// Where the AWS client asks for instance credentials when it has none.
const METADATA_HOST: &str = "169.254.169.254";

impl RemoteStore<S3Backend> {
    /// Validates `cfg`, connects, and checks that the bucket exists and the
    /// credentials are accepted (one LIST request under the prefix).
    pub fn open(cfg: S3Config) -> Result<Self> {
        let cfg = cfg.resolved()?;
        let loc = cfg.validate()?;
        // Requests use rustls with ring (no aws-lc-rs / cmake in the build);
        // installing fails harmlessly when a provider is already in place.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let runtime = Runtime::new("ucm-s3", cfg.io_threads)?;
        let client = build_client(&cfg, &loc)?;
        let prefix = if loc.prefix.is_empty() {
            ObjPath::default()
        } else {
            ObjPath::parse(&loc.prefix)
                .map_err(|e| UcmError::invalid(format!("storage_backends: {e}")))?
        };
        let shared = Arc::new(S3Backend::new(cfg, loc, client, prefix, runtime.handle()));
        if let Err(e) = shared.check_access() {
            runtime.shutdown(Duration::from_secs(1));
            return Err(e);
        }
        log::info!(
            "S3 store over s3://{}/{} at {} (access key {})",
            shared.loc.bucket,
            shared.loc.prefix,
            if shared.cfg.endpoint.is_empty() {
                "AWS"
            } else {
                &shared.cfg.endpoint
            },
            config::redact(&shared.cfg.access_key)
        );
        Ok(RemoteStore::new(shared, runtime))
    }

    /// The object key of a block (for tools and tests).
    pub fn object_key(&self, id: &BlockId) -> String {
        self.backend().path(id).to_string()
    }
}

/// The bucket's client: retries, timeouts and connection pool per `cfg`.
fn build_client(cfg: &S3Config, loc: &S3Location) -> Result<Arc<AmazonS3>> {
    let request_timeout = Duration::from_millis(if cfg.timeout_ms == 0 {
        30_000
    } else {
        cfg.timeout_ms
    });
    let builder = AmazonS3Builder::from_env()
        .with_bucket_name(&loc.bucket)
        .with_virtual_hosted_style_request(cfg.virtual_hosted_style)
        .with_retry(RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: cfg.retries,
            retry_timeout: request_timeout,
        })
        .with_client_options(
            ClientOptions::new()
                .with_timeout(request_timeout)
                .with_connect_timeout(request_timeout.min(Duration::from_secs(5)))
                .with_pool_max_idle_per_host(cfg.max_concurrency)
                .with_allow_http(cfg.endpoint.starts_with("http://")),
        );
    let client = with_account(builder, cfg)
        .build()
        .map_err(|e| UcmError::invalid(format!("S3 store for {}: {e}", cfg.url)))?;
    Ok(Arc::new(client))
}

/// The endpoint, region and credentials `cfg` names; what it leaves empty
/// comes from the environment (the region defaults to `us-east-1`).
fn with_account(mut builder: AmazonS3Builder, cfg: &S3Config) -> AmazonS3Builder {
    if !cfg.endpoint.is_empty() {
        builder = builder
            .with_endpoint(&cfg.endpoint)
            .with_allow_http(cfg.endpoint.starts_with("http://"));
    }
    if !cfg.region.is_empty() {
        builder = builder.with_region(&cfg.region);
    } else if std::env::var("AWS_REGION").is_err() && std::env::var("AWS_DEFAULT_REGION").is_err() {
        builder = builder.with_region("us-east-1");
    }
    if !cfg.access_key.is_empty() {
        builder = builder
            .with_access_key_id(&cfg.access_key)
            .with_secret_access_key(&cfg.secret_key);
    }
    if !cfg.session_token.is_empty() {
        builder = builder.with_token(&cfg.session_token);
    }
    builder
}

impl S3Backend {
    fn new(
        cfg: S3Config,
        loc: S3Location,
        client: Arc<AmazonS3>,
        prefix: ObjPath,
        handle: tokio::runtime::Handle,
    ) -> Self {
        let layout = cfg.geometry.layout();
        let core = RemoteCore::new(
            layout,
            handle,
            LookupCache::from_ttl_ms(cfg.lookup_cache_ttl_ms, cfg.negative_cache_ttl_ms),
            Arc::new(Breaker::default()),
            cfg.timeout_ms,
            cfg.max_concurrency,
            cfg.transfers_enabled(),
        );
        S3Backend {
            core,
            location: format!("s3://{}/{}", loc.bucket, loc.prefix),
            limiter: tokio::sync::Semaphore::new(cfg.max_concurrency),
            stager: Stager::new(cfg.staging_bytes),
            counters: RequestCounters::default(),
            client,
            prefix,
            loc,
            cfg,
        }
    }

    fn path(&self, id: &BlockId) -> ObjPath {
        let (dir, name) = crate::store::format::codec::block_key(id);
        self.prefix.clone().join(dir).join(name)
    }

    fn url_of(&self, id: &BlockId) -> String {
        format!("s3://{}/{}", self.loc.bucket, self.path(id))
    }

    /// True when some credential source other than the instance metadata
    /// service is configured: the config's keys, or the AWS environment
    /// variables the client reads (static keys, web identity, containers).
    fn has_credentials(&self) -> bool {
        !self.cfg.access_key.is_empty()
            || [
                "AWS_ACCESS_KEY_ID",
                "AWS_WEB_IDENTITY_TOKEN_FILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            ]
            .iter()
            .any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()))
    }

    /// One LIST under the prefix: proves the endpoint answers, the bucket
    /// exists and the credentials are accepted.
    fn check_access(self: &Arc<Self>) -> Result<()> {
        let s = self.clone();
        let budget = Duration::from_millis(self.cfg.timeout_ms.clamp(1, 30_000));
        let outcome = run_blocking(&self.core.handle, async move {
            let prefix = (!s.loc.prefix.is_empty()).then_some(&s.prefix);
            tokio::time::timeout(budget, s.client.list_with_delimiter(prefix)).await
        })?;
        let endpoint = if self.cfg.endpoint.is_empty() {
            "AWS".to_string()
        } else {
            self.cfg.endpoint.clone()
        };
        match outcome {
            Ok(Ok(_)) => Ok(()),
            // Without credentials, the AWS client falls back to the instance
            // metadata service; its failure would hide the real cause.
            Ok(Err(e)) if !self.has_credentials() || e.to_string().contains(METADATA_HOST) => {
                Err(UcmError::invalid(format!(
                    "s3_access_key / s3_secret_key: no S3 credentials are configured for \
                     {endpoint} (bucket {:?}): set s3_access_key and s3_secret_key (for example \
                     \"${{AWS_ACCESS_KEY_ID}}\" and \"${{AWS_SECRET_ACCESS_KEY}}\"), or the \
                     AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY environment variables; without \
                     them the instance metadata service was asked, and it failed: {e}",
                    self.loc.bucket
                )))
            }
            Ok(Err(e)) => {
                let msg = e.to_string();
                Err(match e {
                    object_store::Error::NotFound { .. } => UcmError::invalid(format!(
                        "storage_backends: bucket {:?} does not exist at {endpoint}",
                        self.loc.bucket
                    )),
                    object_store::Error::PermissionDenied { .. }
                    | object_store::Error::Unauthenticated { .. } => UcmError::invalid(format!(
                        "s3_access_key / s3_secret_key: {endpoint} rejected the credentials \
                         (access key {:?}) for bucket {:?}: {msg}",
                        config::redact(&self.cfg.access_key),
                        self.loc.bucket
                    )),
                    _ if msg.contains("NoSuchBucket") => UcmError::invalid(format!(
                        "storage_backends: bucket {:?} does not exist at {endpoint}",
                        self.loc.bucket
                    )),
                    _ if msg.contains("InvalidAccessKeyId")
                        || msg.contains("SignatureDoesNotMatch")
                        || msg.contains("AccessDenied")
                        || msg.contains("status code: 403") =>
                    {
                        UcmError::invalid(format!(
                            "s3_access_key / s3_secret_key: {endpoint} rejected the credentials \
                             (access key {:?}) for bucket {:?}: {msg}",
                            config::redact(&self.cfg.access_key),
                            self.loc.bucket
                        ))
                    }
                    _ => UcmError::invalid(format!(
                        "s3_endpoint: cannot use {endpoint} for bucket {:?}: {msg}",
                        self.loc.bucket
                    )),
                })
            }
            Err(_) => Err(UcmError::Timeout(format!(
                "s3_endpoint: {endpoint} did not answer within {budget:?}"
            ))),
        }
    }

    fn note_err(&self, op: &str, what: &str, e: object_store::Error) -> UcmError {
        let (err, transport) = map_err(op, what, e);
        if transport {
            self.counters.request_errors.fetch_add(1, Ordering::Relaxed);
            self.core.breaker.trip(&err.to_string());
        }
        err
    }
}

impl RemoteBackend for S3Backend {
    const NAME: &'static str = "S3";
    const PROBE_STAT: &'static str = "head_requests";
    type Region = Bytes;

    fn core(&self) -> &RemoteCore {
        &self.core
    }

    fn location(&self) -> &str {
        &self.location
    }

    /// One HEAD: presence and size.
    async fn size_of(&self, id: &BlockId) -> Result<Option<u64>> {
        let path = self.path(id);
        let res = {
            let _permit = self.limiter.acquire().await;
            self.client.head(&path).await
        };
        match res {
            Ok(meta) => {
                self.core.breaker.reset();
                Ok(Some(meta.size))
            }
            Err(object_store::Error::NotFound { .. }) => {
                self.core.breaker.reset();
                Ok(None)
            }
            Err(e) => Err(self.note_err("HEAD", &self.url_of(id), e)),
        }
    }

    /// One range GET.
    async fn read(&self, id: &BlockId, offset: u64, len: usize) -> Result<Bytes> {
        let path = self.path(id);
        let res = {
            let _permit = self.limiter.acquire().await;
            self.counters.gets.fetch_add(1, Ordering::Relaxed);
            self.client
                .get_range(&path, offset..offset + len as u64)
                .await
        };
        res.map_err(|e| self.note_err("GET", &self.url_of(id), e))
    }

    async fn discard_corrupt(&self, id: &BlockId, e: &UcmError) {
        if !is_layout_mismatch(e) {
            // Useless to every reader: let the next dump rewrite it.
            log::warn!("{e}; deleting {}", self.url_of(id));
            let _ = self.client.delete(&self.path(id)).await;
        }
    }

    async fn dump_group(self: Arc<Self>, block: BlockId, shards: Vec<ShardIo>) -> Result<()> {
        staging::stage(self, block, shards).await
    }

    fn before_shutdown(self: &Arc<Self>) {
        self.drain_uploads();
    }

    fn add_stats(&self, put: &mut dyn FnMut(&str, u64)) {
        self.counters.add_stats(put);
        self.stager.add_stats(put);
    }
}

impl Uploader for S3Backend {
    fn stager(&self) -> &Stager {
        &self.stager
    }

    /// One PUT of the whole block.
    async fn put_block(self: Arc<Self>, block: BlockId, buf: Vec<u8>) -> Result<()> {
        let path = self.path(&block);
        let _permit = self.limiter.acquire().await;
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.client
            .put(&path, PutPayload::from(Bytes::from(buf)))
            .await
            .map(|_| ())
            .map_err(|e| self.note_err("PUT", &self.url_of(&block), e))
    }
}
