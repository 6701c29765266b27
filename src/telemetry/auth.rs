//! Who may scrape `/metrics`: a caller whose bearer token passes a TokenReview and who may `get`
//! the non-resource URL `/metrics` (a SubjectAccessReview with the user, groups, uid and extra
//! the TokenReview returned), as controller-runtime's `WithAuthenticationAndAuthorization`
//! filter and kube-rbac-proxy decide. Both reviews are made with a client of their own
//! (`run` builds it from the same configuration as the controller's, so it has its own
//! connection pool: a flood of tokens never queues behind, or in front of, reconciles).
//!
//! Decisions are cached by the token's SHA-256 (never the token itself) for a short time, so a
//! Prometheus scraping every 15 s costs the API server two reviews per [`ALLOWED_TTL`], not two per
//! scrape; a refusal is kept shorter ([`DENIED_TTL`]) so that a new RoleBinding takes effect soon.
//!
//! Under a flood of made-up tokens:
//! - at most [`MAX_REVIEWS_IN_FLIGHT`] reviews run at once; a caller that waits longer than
//!   [`REVIEW_WAIT`] for a turn gets [`CheckError::Busy`] (503 with `Retry-After`), uncached;
//! - concurrent requests with the same token share one review (single flight);
//! - allowed and refused decisions are cached apart, each least-recently-used first out, so
//!   refusals (all a flood of bogus tokens can produce) never evict an allowed scraper.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tracing::Instrument;

/// The non-resource URL a scraper must be allowed to `get`.
pub const METRICS_PATH: &str = "/metrics";
/// How long an allowed token stays allowed without a new review.
pub const ALLOWED_TTL: Duration = Duration::from_secs(30);
/// How long a refused token (401 or 403) stays refused without a new review.
pub const DENIED_TTL: Duration = Duration::from_secs(10);
/// At most this many cached allowed decisions (scrapers: a few).
pub const MAX_ALLOWED: usize = 256;
/// At most this many cached refusals (a flood of made-up tokens cannot grow memory).
pub const MAX_DENIED: usize = 1024;
/// At most this many token reviews (each a TokenReview, then maybe a SubjectAccessReview) at once.
pub const MAX_REVIEWS_IN_FLIGHT: usize = 4;
/// How long a request waits for a review turn before it is answered 503.
pub const REVIEW_WAIT: Duration = Duration::from_secs(2);

/// A token's SHA-256.
type Key = [u8; 32];

/// What a scrape with a token gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// 200: authenticated and allowed to `get` `/metrics`.
    Allowed,
    /// 401: the API server does not know the token.
    Unauthenticated,
    /// 403: a known user who may not `get` `/metrics`.
    Forbidden,
}

/// Why a token could not be decided (never cached).
#[derive(Clone, Debug, thiserror::Error)]
pub enum CheckError {
    /// The API server unreachable, or the operator not allowed to review.
    #[error("cannot review the token with the API server: {0}")]
    Review(Arc<kube::Error>),
    /// [`MAX_REVIEWS_IN_FLIGHT`] reviews ran for all of [`REVIEW_WAIT`].
    #[error("too many token reviews in flight")]
    Busy,
}

/// The token of an `Authorization: Bearer <token>` header value (scheme case-insensitive).
pub fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// A bounded map of decisions by token hash that drops its least recently used entry when full
/// (and an entry past `ttl` when read).
#[derive(Debug)]
struct Lru {
    cap: usize,
    ttl: Duration,
    tick: u64,
    /// Key -> (when decided, the decision, the tick of its last use).
    entries: HashMap<Key, (Instant, Decision, u64)>,
    /// Tick of last use -> key: the first is the least recently used.
    order: BTreeMap<u64, Key>,
}

impl Lru {
    fn new(cap: usize, ttl: Duration) -> Self {
        Lru {
            cap,
            ttl,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn get(&mut self, key: &Key, now: Instant) -> Option<Decision> {
        let &(at, d, used) = self.entries.get(key)?;
        if now.saturating_duration_since(at) >= self.ttl {
            self.remove(key);
            return None;
        }
        let tick = self.next_tick();
        self.order.remove(&used);
        self.order.insert(tick, *key);
        self.entries.insert(*key, (at, d, tick));
        Some(d)
    }

    fn remove(&mut self, key: &Key) {
        if let Some((_, _, used)) = self.entries.remove(key) {
            self.order.remove(&used);
        }
    }

    fn put(&mut self, key: Key, d: Decision, now: Instant) {
        self.remove(&key);
        while self.entries.len() >= self.cap {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.entries.remove(&oldest);
        }
        let tick = self.next_tick();
        self.order.insert(tick, key);
        self.entries.insert(key, (now, d, tick));
    }
}

/// Decisions by token hash, each with when it was made: allowed ones and refusals in separate
/// bounded LRU maps, so that refusals never push an allowed decision out.
#[derive(Debug)]
pub struct DecisionCache {
    allowed: Lru,
    denied: Lru,
}

impl Default for DecisionCache {
    fn default() -> Self {
        DecisionCache {
            allowed: Lru::new(MAX_ALLOWED, ALLOWED_TTL),
            denied: Lru::new(MAX_DENIED, DENIED_TTL),
        }
    }
}

impl DecisionCache {
    /// The decision for `key` made less than its TTL before `now` (and now its most recent use).
    pub fn get(&mut self, key: &Key, now: Instant) -> Option<Decision> {
        self.allowed
            .get(key, now)
            .or_else(|| self.denied.get(key, now))
    }

    pub fn put(&mut self, key: Key, d: Decision, now: Instant) {
        if d == Decision::Allowed {
            self.denied.remove(&key);
            self.allowed.put(key, d, now);
        } else {
            self.allowed.remove(&key);
            self.denied.put(key, d, now);
        }
    }

    pub fn len(&self) -> usize {
        self.allowed.entries.len() + self.denied.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Makes the reviews of one token: [`KubeReviewer`] with the API server; tests count calls.
pub trait Reviewer: Send + Sync + 'static {
    fn review<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Decision, kube::Error>>;
}

/// A TokenReview, then (for an authenticated user) a SubjectAccessReview of `get /metrics`.
#[derive(Clone)]
pub struct KubeReviewer(pub kube::Client);

impl Reviewer for KubeReviewer {
    fn review<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Decision, kube::Error>> {
        kube_review(self.0.clone(), token).boxed()
    }
}

async fn kube_review(client: kube::Client, token: &str) -> Result<Decision, kube::Error> {
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_string()),
            ..Default::default()
        },
        ..Default::default()
    };
    let reviewed = Api::<TokenReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await?;
    let status = reviewed.status.unwrap_or_default();
    let Some(user) = status.user.filter(|_| status.authenticated == Some(true)) else {
        return Ok(Decision::Unauthenticated);
    };
    let access = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username,
            groups: user.groups,
            uid: user.uid,
            extra: user.extra,
            non_resource_attributes: Some(NonResourceAttributes {
                path: Some(METRICS_PATH.into()),
                verb: Some("get".into()),
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let reviewed = Api::<SubjectAccessReview>::all(client)
        .create(&PostParams::default(), &access)
        .await?;
    Ok(if reviewed.status.is_some_and(|s| s.allowed) {
        Decision::Allowed
    } else {
        Decision::Forbidden
    })
}

/// One review under way, awaited by every request with its token.
type Flight = Shared<BoxFuture<'static, Result<Decision, CheckError>>>;

struct Inner {
    reviewer: Box<dyn Reviewer>,
    /// Locked after `in_flight` when both are.
    cache: Mutex<DecisionCache>,
    in_flight: Mutex<HashMap<Key, Flight>>,
    turns: Semaphore,
    wait: Duration,
}

/// Reviews scrapers' tokens with the API server: cached, single-flight per token, at most
/// [`MAX_REVIEWS_IN_FLIGHT`] at once.
#[derive(Clone)]
pub struct Authorizer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authorizer").finish_non_exhaustive()
    }
}

impl Authorizer {
    /// Reviews with `client` (give it a client of its own: see the module's documentation).
    pub fn new(client: kube::Client) -> Self {
        Self::with_reviewer(KubeReviewer(client), MAX_REVIEWS_IN_FLIGHT, REVIEW_WAIT)
    }

    /// Reviews with `reviewer`, at most `in_flight` at once, a caller waiting at most `wait`.
    pub fn with_reviewer(reviewer: impl Reviewer, in_flight: usize, wait: Duration) -> Self {
        Authorizer {
            inner: Arc::new(Inner {
                reviewer: Box::new(reviewer),
                cache: Mutex::new(DecisionCache::default()),
                in_flight: Mutex::new(HashMap::new()),
                turns: Semaphore::new(in_flight),
                wait,
            }),
        }
    }

    /// Whether `token` may scrape: cached, or the review already under way for the same token,
    /// or a new one once a turn is free. Errors are not cached.
    pub async fn check(&self, token: &str) -> Result<Decision, CheckError> {
        let key: Key = Sha256::digest(token.as_bytes()).into();
        let flight = {
            let mut in_flight = self.inner.in_flight.lock().unwrap();
            if let Some(d) = self.inner.cache.lock().unwrap().get(&key, Instant::now()) {
                return Ok(d);
            }
            in_flight
                .entry(key)
                .or_insert_with(|| Self::fly(self.inner.clone(), key, token.to_string()))
                .clone()
        };
        flight.await
    }

    /// The review of `token`, shared; on its end it caches a decision and leaves `in_flight`
    /// (both under the lock `check` reads them under, so no request starts a second review).
    /// A task of its own drives it to the end, so a review whose callers all hung up still
    /// finishes, leaves `in_flight` and frees its turn.
    fn fly(inner: Arc<Inner>, key: Key, token: String) -> Flight {
        let span = tracing::debug_span!("metrics_token_review");
        let flight = async move {
            let result = match tokio::time::timeout(inner.wait, inner.turns.acquire()).await {
                Ok(Ok(_turn)) => inner
                    .reviewer
                    .review(&token)
                    .await
                    .map_err(|e| CheckError::Review(Arc::new(e))),
                _ => Err(CheckError::Busy),
            };
            let mut in_flight = inner.in_flight.lock().unwrap();
            if let Ok(d) = result {
                inner.cache.lock().unwrap().put(key, d, Instant::now());
            }
            in_flight.remove(&key);
            result
        }
        .instrument(span)
        .boxed()
        .shared();
        tokio::spawn(flight.clone());
        flight
    }

    /// How many decisions are cached.
    pub fn cached(&self) -> usize {
        self.inner.cache.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_header() {
        assert_eq!(bearer_token("Bearer abc.def"), Some("abc.def"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic dXNlcjpwdw=="), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
    }

    fn key(i: usize) -> Key {
        let mut k = [0xff; 32];
        k[..8].copy_from_slice(&(i as u64).to_le_bytes());
        k
    }

    #[test]
    fn decisions_expire_refusals_sooner() {
        let t0 = Instant::now();
        let mut c = DecisionCache::default();
        c.put([1; 32], Decision::Allowed, t0);
        c.put([2; 32], Decision::Forbidden, t0);
        c.put([3; 32], Decision::Unauthenticated, t0);
        let soon = t0 + DENIED_TTL - Duration::from_millis(1);
        assert_eq!(c.get(&[1; 32], soon), Some(Decision::Allowed));
        assert_eq!(c.get(&[2; 32], soon), Some(Decision::Forbidden));
        assert_eq!(c.get(&[3; 32], soon), Some(Decision::Unauthenticated));
        let later = t0 + DENIED_TTL;
        assert_eq!(c.get(&[1; 32], later), Some(Decision::Allowed));
        assert_eq!(c.get(&[2; 32], later), None);
        assert_eq!(c.get(&[3; 32], later), None);
        assert_eq!(c.get(&[1; 32], t0 + ALLOWED_TTL), None);
        assert_eq!(c.get(&[4; 32], t0), None);
        // A token refused, then allowed (a new RoleBinding), is only allowed.
        c.put([5; 32], Decision::Forbidden, t0);
        c.put([5; 32], Decision::Allowed, t0);
        assert_eq!(c.get(&[5; 32], soon), Some(Decision::Allowed));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn a_flood_of_bogus_tokens_keeps_the_allowed_ones_and_the_bound() {
        let t0 = Instant::now();
        let mut c = DecisionCache::default();
        c.put([1; 32], Decision::Allowed, t0);
        c.put([2; 32], Decision::Allowed, t0);
        for i in 0..10 * MAX_DENIED {
            c.put(key(i), Decision::Unauthenticated, t0);
            assert!(c.len() <= MAX_ALLOWED + MAX_DENIED);
        }
        assert_eq!(c.get(&[1; 32], t0), Some(Decision::Allowed));
        assert_eq!(c.get(&[2; 32], t0), Some(Decision::Allowed));
        // The refusals kept are the latest: the oldest went first.
        assert_eq!(c.get(&key(0), t0), None);
        let last = 10 * MAX_DENIED - 1;
        assert_eq!(c.get(&key(last), t0), Some(Decision::Unauthenticated));
        assert_eq!(c.len(), 2 + MAX_DENIED);
    }

    #[test]
    fn a_full_map_evicts_its_least_recently_used_entry() {
        let t0 = Instant::now();
        let mut c = DecisionCache::default();
        for i in 0..MAX_ALLOWED {
            c.put(key(i), Decision::Allowed, t0);
        }
        // Read 0: now 1 is the least recently used.
        assert_eq!(c.get(&key(0), t0), Some(Decision::Allowed));
        c.put(key(MAX_ALLOWED), Decision::Allowed, t0);
        assert_eq!(c.get(&key(0), t0), Some(Decision::Allowed));
        assert_eq!(c.get(&key(1), t0), None);
        assert_eq!(c.get(&key(2), t0), Some(Decision::Allowed));
        assert_eq!(c.len(), MAX_ALLOWED);
    }

    /// Counts reviews; each takes `delay` and allows tokens starting with "good".
    struct Counting {
        reviews: Arc<AtomicUsize>,
        running: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
        delay: Duration,
    }

    impl Reviewer for Counting {
        fn review<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Decision, kube::Error>> {
            async move {
                self.reviews.fetch_add(1, Ordering::SeqCst);
                let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
                self.most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(self.delay).await;
                self.running.fetch_sub(1, Ordering::SeqCst);
                Ok(if token.starts_with("good") {
                    Decision::Allowed
                } else {
                    Decision::Unauthenticated
                })
            }
            .boxed()
        }
    }

    fn counting(delay: Duration) -> (Counting, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let (reviews, most) = (Arc::default(), Arc::<AtomicUsize>::default());
        let r = Counting {
            reviews: Arc::clone(&reviews),
            running: Arc::default(),
            most: Arc::clone(&most),
            delay,
        };
        (r, reviews, most)
    }

    #[tokio::test]
    async fn concurrent_requests_with_one_token_share_one_review() {
        let (r, reviews, _) = counting(Duration::from_millis(50));
        let auth = Authorizer::with_reviewer(r, 4, Duration::from_secs(5));
        let calls = (0..50).map(|_| {
            let auth = auth.clone();
            tokio::spawn(async move { auth.check("good-token").await })
        });
        for d in futures::future::join_all(calls).await {
            assert_eq!(d.unwrap().unwrap(), Decision::Allowed);
        }
        assert_eq!(reviews.load(Ordering::SeqCst), 1);
        // Then cached.
        assert_eq!(auth.check("good-token").await.unwrap(), Decision::Allowed);
        assert_eq!(reviews.load(Ordering::SeqCst), 1);
        assert_eq!(auth.inner.in_flight.lock().unwrap().len(), 0);
    }

    #[tokio::test]
    async fn a_review_whose_callers_hung_up_still_ends_and_frees_its_turn() {
        let (r, reviews, _) = counting(Duration::from_millis(100));
        let auth = Authorizer::with_reviewer(r, 1, Duration::from_millis(50));
        let hung_up = tokio::time::timeout(Duration::from_millis(10), auth.check("bogus")).await;
        assert!(hung_up.is_err());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(auth.inner.in_flight.lock().unwrap().is_empty());
        assert_eq!(auth.check("good").await.unwrap(), Decision::Allowed);
        assert_eq!(reviews.load(Ordering::SeqCst), 2);
        assert_eq!(auth.cached(), 2);
    }

    #[tokio::test]
    async fn reviews_in_flight_are_capped_and_the_rest_are_told_busy() {
        let (r, reviews, most) = counting(Duration::from_millis(300));
        let auth = Authorizer::with_reviewer(r, 4, Duration::from_millis(100));
        let calls = (0..20).map(|i| {
            let auth = auth.clone();
            tokio::spawn(async move { auth.check(&format!("bogus-{i}")).await })
        });
        let results: Vec<_> = futures::future::join_all(calls)
            .await
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(most.load(Ordering::SeqCst), 4);
        assert_eq!(reviews.load(Ordering::SeqCst), 4);
        let busy = results
            .iter()
            .filter(|r| matches!(r, Err(CheckError::Busy)))
            .count();
        assert_eq!(busy, 16, "{results:?}");
        // Busy is not cached: the same token is reviewed once a turn is free.
        let again = auth.check("good-later").await;
        assert_eq!(again.unwrap(), Decision::Allowed);
        assert_eq!(auth.cached(), 5);
    }
}
