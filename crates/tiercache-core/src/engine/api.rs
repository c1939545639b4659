//! The programmatic API: values by key, raw bytes or any serde type, through
//! the same orchestration as the HTTP layer ([`TieredCache::fetch`]).

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::TieredCache;
use super::journal::Footprint;
use super::store::later;
use crate::{
    CacheKey, Entry, FetchError, Fetched, Fill, Freshness, Loaded, MAX_TTL, Origin, Policy, Select,
    Times, Value,
};

/// What a loader answers: a value to store, or one to return without
/// storing it (Cachex's `{:ignore, value}`: a partial or provisional result).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Commit<V> {
    /// Store it, and answer with it.
    Store(V),
    /// Answer with it (and the requests waiting on this load), but do not store it.
    Ignore(V),
}

/// Why a programmatic load has no value.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoadError<E> {
    /// The loader failed.
    Loader(E),
    /// The load this call waited on failed, or was cancelled.
    Failed,
    /// The loader panicked (this caller's, or the one it waited on).
    Panicked,
    /// The value could not be encoded (typed calls).
    Encode(String),
}

impl<E: fmt::Display> fmt::Display for LoadError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Loader(e) => write!(f, "loading the value failed: {e}"),
            LoadError::Failed => f.write_str("the load this call waited on failed"),
            LoadError::Panicked => f.write_str("loading the value panicked"),
            LoadError::Encode(e) => write!(f, "the value could not be encoded: {e}"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for LoadError<E> {}

impl<E> From<FetchError<E>> for LoadError<E> {
    fn from(e: FetchError<E>) -> Self {
        match e {
            FetchError::Origin(e) => LoadError::Loader(e),
            FetchError::Failed => LoadError::Failed,
            FetchError::Panicked(_) => LoadError::Panicked,
        }
    }
}

/// The field that marks a typed value with its type, so another type stored
/// under the same key reads as a miss.
const TYPE_FIELD: &[u8] = b"tiercache-type";

/// A value of a serde type, as stored: MessagePack with field names (so a
/// struct whose fields changed between deploys fails to decode, a miss,
/// instead of decoding into the wrong fields), marked with its type's name.
fn encode<T: Serialize>(value: &T) -> Result<Value, String> {
    let body = rmp_serde::to_vec_named(value).map_err(|e| e.to_string())?;
    Ok(Value {
        status: 200,
        headers: vec![(
            Bytes::from_static(TYPE_FIELD),
            Bytes::from_static(std::any::type_name::<T>().as_bytes()),
        )],
        body: Bytes::from(body),
    })
}

fn is_type<T>(value: &Value) -> bool {
    value
        .headers
        .iter()
        .any(|(n, v)| n == TYPE_FIELD && v == std::any::type_name::<T>().as_bytes())
}

fn decode<T: DeserializeOwned>(value: &Value) -> Option<T> {
    is_type::<T>(value)
        .then(|| rmp_serde::from_slice(&value.body).ok())
        .flatten()
}

/// A loader closure as an origin: stores or ignores what it answers.
struct LoaderOrigin<F, A> {
    load: F,
    accepts: A,
}

impl<F, A: Fn(&Entry) -> bool> Select for LoaderOrigin<F, A> {
    fn accepts(&self, entry: &Entry) -> bool {
        (self.accepts)(entry)
    }
}

impl<F, Fut, E, A> Origin for LoaderOrigin<F, A>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<Commit<Value>, E>> + Send,
    E: Send + 'static,
    A: Fn(&Entry) -> bool + Send + 'static,
{
    type Output = Infallible;
    type Error = E;

    async fn load(self, _stale: Option<Entry>) -> Result<Loaded<Infallible>, E> {
        Ok(match (self.load)().await? {
            Commit::Store(value) => Loaded::Store(Fill::new(value)),
            Commit::Ignore(value) => Loaded::Share {
                value,
                failed: false,
            },
        })
    }
}

impl TieredCache {
    /// Reads `key` without loading: a fresh L1 entry, else a fresh L2 one
    /// (promoted to L1). Not counted as a hit or a miss.
    pub async fn get(&self, key: &CacheKey) -> Option<Value> {
        self.current(key).await.map(|e| e.value().clone())
    }

    /// Reads `key` as a `T` stored by [`put_as`](Self::put_as) or
    /// [`get_or_load_as`](Self::get_or_load_as); another type, or bytes that
    /// do not decode, read as a miss.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Policy, TieredCache};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
    /// struct User { id: u32, name: String }
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cache = TieredCache::builder().build()?;
    /// let policy = Policy::ttl(Duration::from_secs(60)).build()?;
    /// let key = CacheKey::new("user:7");
    /// cache.put_as(&key, &User { id: 7, name: "Ada".into() }, &policy)?;
    /// assert_eq!(cache.get_as::<User>(&key).await, Some(User { id: 7, name: "Ada".into() }));
    /// assert_eq!(cache.get_as::<String>(&key).await, None);
    /// # Ok(()) }
    /// ```
    pub async fn get_as<T: DeserializeOwned>(&self, key: &CacheKey) -> Option<T> {
        decode(&self.get(key).await?)
    }

    /// Stores a value (or a [`Fill`], to say more: origin time, lifetime,
    /// tags) under `key` with `policy`'s ttl and tags, in L1 and L2, and
    /// returns the stored entry.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Fill, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cache = TieredCache::builder().build()?;
    /// let policy = Policy::ttl(Duration::from_secs(60)).build()?;
    /// cache.put(&CacheKey::new("a"), Value::from_body("v"), &policy);
    /// let entry = cache.put(&CacheKey::new("b"), Fill::new(Value::from_body("v")).origin_latency(Duration::from_millis(30)), &policy);
    /// assert_eq!(entry.origin_latency(), Duration::from_millis(30));
    /// # Ok(()) }
    /// ```
    pub fn put(&self, key: &CacheKey, value: impl Into<Fill>, policy: &Policy) -> Entry {
        self.store_now(key, value.into(), policy)
    }

    /// Stores a serde value under `key` (see [`get_as`](Self::get_as)).
    pub fn put_as<T: Serialize>(
        &self,
        key: &CacheKey,
        value: &T,
        policy: &Policy,
    ) -> Result<(), LoadError<Infallible>> {
        self.put(key, encode(value).map_err(LoadError::Encode)?, policy);
        Ok(())
    }

    /// Returns `key`'s value, loading it with `loader` when no tier has it,
    /// through the whole orchestration of [`fetch`](Self::fetch): one load
    /// per key (per fleet with a shared tier), L2 before the loader,
    /// stale-while-revalidate and XFetch refreshes, stale-if-error, and an
    /// invalidation during the load keeps it from being stored.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    /// let key = CacheKey::new("report");
    /// let v = cache.get_or_load(&key, &policy, || async { Ok::<_, ()>(Value::from_body("built")) }).await;
    /// assert_eq!(v.unwrap().body, "built");
    /// let again = cache.get_or_load(&key, &policy, || async { Err::<Value, _>("not called") }).await;
    /// assert_eq!(again.unwrap().body, "built");
    /// # }
    /// ```
    pub async fn get_or_load<F, Fut, E>(
        &self,
        key: &CacheKey,
        policy: &Policy,
        loader: F,
    ) -> Result<Value, LoadError<E>>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Value, E>> + Send + 'static,
        E: Send + 'static,
    {
        self.get_or_load_with(
            key,
            policy,
            || async move { loader().await.map(Commit::Store) },
        )
        .await
    }

    /// Like [`get_or_load`](Self::get_or_load), with a loader that may
    /// answer without storing ([`Commit::Ignore`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Commit, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(60)).build().unwrap();
    /// let key = CacheKey::new("quote");
    /// let partial = cache
    ///     .get_or_load_with(&key, &policy, || async { Ok::<_, ()>(Commit::Ignore(Value::from_body("partial"))) })
    ///     .await;
    /// assert_eq!(partial.unwrap().body, "partial");
    /// assert!(!cache.exists(&key).await, "an ignored value is not stored");
    /// # }
    /// ```
    pub async fn get_or_load_with<F, Fut, E>(
        &self,
        key: &CacheKey,
        policy: &Policy,
        loader: F,
    ) -> Result<Value, LoadError<E>>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Commit<Value>, E>> + Send + 'static,
        E: Send + 'static,
    {
        let origin = LoaderOrigin {
            load: loader,
            accepts: |_: &Entry| true,
        };
        match self.fetch(key, policy, origin).await? {
            Fetched::Entry(answer) => Ok(answer.entry.value().clone()),
            Fetched::Passed { output, .. } => match output {},
        }
    }

    /// [`get_or_load`](Self::get_or_load) for any serde type: the value is
    /// stored as compact MessagePack; another type under the key, or bytes
    /// that no longer decode (the type changed between deploys), are a miss
    /// that the loader fills.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tiercache_core::{CacheKey, Policy, TieredCache};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize, Clone, PartialEq, Debug)]
    /// struct Price { cents: u64 }
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cache = TieredCache::builder().build()?;
    /// let policy = Policy::ttl(Duration::from_secs(60)).build()?;
    /// let key = CacheKey::new("price:7");
    /// let price = cache.get_or_load_as(&key, &policy, || async { Ok::<_, ()>(Price { cents: 1999 }) }).await;
    /// assert_eq!(price.unwrap(), Price { cents: 1999 });
    /// # Ok(()) }
    /// ```
    pub async fn get_or_load_as<T, F, Fut, E>(
        &self,
        key: &CacheKey,
        policy: &Policy,
        loader: F,
    ) -> Result<T, LoadError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: Send + 'static,
    {
        // The loader's own value comes back as is: decoding it again could
        // only fail where encoding did.
        let (tx, mut rx) = tokio::sync::oneshot::channel::<T>();
        let origin = LoaderOrigin {
            load: || async move {
                let value = loader().await?;
                let commit = match encode(&value) {
                    Ok(stored) => Commit::Store(stored),
                    // A value that does not encode is answered, not stored.
                    Err(_) => Commit::Ignore(Value::default()),
                };
                let _ = tx.send(value);
                Ok(commit)
            },
            accepts: |e: &Entry| decode::<T>(e.value()).is_some(),
        };
        let fetched = self.fetch(key, policy, origin).await?;
        // Sent already when this call's load answered it; a load that went
        // on in the background (a refresh, or past the soft timeout) is not
        // waited for: the answer is the entry.
        if let Ok(own) = rx.try_recv() {
            return Ok(own);
        }
        match fetched {
            Fetched::Entry(answer) => decode(answer.entry.value()).ok_or(LoadError::Failed),
            Fetched::Passed { output, .. } => match output {},
        }
    }

    /// The fresh lifetime `key` has left (L1, else L2); `None` when absent or stale.
    pub async fn ttl(&self, key: &CacheKey) -> Option<Duration> {
        let now = self.now();
        match self.current(key).await?.freshness(now) {
            Freshness::Fresh(left) => Some(left),
            _ => None,
        }
    }

    /// Whether a fresh value is stored under `key` (L1, else L2).
    pub async fn exists(&self, key: &CacheKey) -> bool {
        self.current(key).await.is_some()
    }

    /// Sets the time `key` has left to `ttl` from now, in L1 and L2 (stale
    /// windows dropped). Returns whether there was a fresh value to expire.
    pub async fn expire(&self, key: &CacheKey, ttl: Duration) -> bool {
        let now = self.now();
        // Clamped, never wrapped to `now`: "keep it" must not turn into a delete.
        self.expire_at(key, later(now, ttl.min(MAX_TTL))).await
    }

    /// Sets `key` to expire at `at` (stale windows dropped), in L1 and L2.
    /// Returns whether there was a fresh value to expire.
    ///
    /// It renews the value it read, and only while that is still the one
    /// stored: in L1, and in the shared tier (see
    /// [`Tier::put_over`](crate::Tier::put_over)). A newer fill stored
    /// meanwhile, here or by another instance, stays as it is.
    ///
    /// The entry keeps the tags it was stored under (in L2 their sets
    /// are renewed with it). [`touch`](Self::touch) renews a fresh lifetime
    /// drawn from a policy instead, and adds the policy's tags.
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use tiercache_core::{CacheKey, Policy, TieredCache, Value};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let cache = TieredCache::builder().sweep_interval(None).build().unwrap();
    /// let policy = Policy::ttl(Duration::from_secs(60)).jitter(0.0).build().unwrap();
    /// let key = CacheKey::new("session");
    /// cache.put(&key, Value::from_body("v"), &policy);
    /// assert!(cache.expire_at(&key, SystemTime::now() + Duration::from_secs(5)).await);
    /// assert!(cache.ttl(&key).await.unwrap() <= Duration::from_secs(5));
    /// # }
    /// ```
    pub async fn expire_at(&self, key: &CacheKey, at: SystemTime) -> bool {
        let now = self.now();
        // Before the read: an invalidation after it keeps the renewal out.
        let epoch = self.inner.journal.epoch();
        let Some(entry) = self.current(key).await else {
            return false;
        };
        // At most the longest lifetime anything is stored for.
        let ttl = at.duration_since(now).unwrap_or_default().min(MAX_TTL);
        if ttl.is_zero() {
            // Queued or landed, it is gone for this instance's answers.
            let _ = self.invalidate(key).await;
            return true;
        }
        let times = Times::fresh(entry.times().created_at.min(now), later(now, ttl));
        self.renew(key, &entry, entry.with_times(times), ttl, epoch);
        true
    }

    /// Resets `key`'s fresh lifetime to a new one drawn from `policy` (its
    /// ttl and jitter), as if it had just been stored. Returns whether there
    /// was a fresh value to touch.
    ///
    /// Like [`expire_at`](Self::expire_at), it renews the value it read and
    /// only that: a newer fill stored meanwhile (in L1, or by another
    /// instance in the shared tier) is left as it is.
    pub async fn touch(&self, key: &CacheKey, policy: &Policy) -> bool {
        // Before the read: an invalidation after it keeps the touch out.
        let epoch = self.inner.journal.epoch();
        let Some(read) = self.current(key).await else {
            return false;
        };
        // Every tag it had (a fill's own too), and the policy's.
        let mut tags = read.tags().to_vec();
        for tag in policy.tags() {
            if !tags.contains(tag) {
                tags.push(tag.clone());
            }
        }
        let (times, ttl) = self.times_for(&Fill::new(read.value().clone()), policy, self.now());
        let renewed = Entry::new(
            key.full().clone(),
            read.variant().clone(),
            read.value().clone(),
            times,
            read.origin_latency(),
        )
        .with_tags(&tags)
        .loaded_by(read.load());
        self.renew(key, &read, renewed, ttl, epoch);
        true
    }

    /// Removes `key` everywhere and returns the fresh value it had, if any.
    pub async fn take(&self, key: &CacheKey) -> Option<Value> {
        let value = self.get(key).await;
        // Queued or landed, it is gone for this instance's answers.
        let _ = self.invalidate(key).await;
        value
    }

    /// The fresh entry under `key`: L1, else L2 (promoted).
    async fn current(&self, key: &CacheKey) -> Option<Entry> {
        let now = self.now();
        if let Some(entry) = self.peek(key, now)
            && matches!(entry.freshness(now), Freshness::Fresh(_))
            && !self.deaf_to_the_fleet()
        {
            return Some(entry);
        }
        let epoch = self.inner.journal.epoch();
        self.lookup_l2(key, epoch, |_| true).await
    }

    /// Stores `renewed`, a renewal of `read`, unless an invalidation since
    /// `epoch` (taken before `read` was read) covers it; and only over
    /// `read` (see [`insert_over`](Self::insert_over)).
    fn renew(&self, key: &CacheKey, read: &Entry, renewed: Entry, ttl: Duration, epoch: u64) {
        let footprint = Footprint {
            hashes: &[key.hash()],
            fulls: &[key.full().as_ref()],
            tags: renewed.tags(),
        };
        let _ = self.inner.journal.unless_overtaken(epoch, &footprint, || {
            self.insert_over(key, renewed.clone(), ttl, read)
        });
        self.inner.prune_tags_if_due();
    }
}
