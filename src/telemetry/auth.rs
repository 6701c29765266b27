//! Who may scrape `/metrics`: a caller whose bearer token passes a TokenReview and who may `get`
//! the non-resource URL `/metrics` (a SubjectAccessReview with the user, groups, uid and extra
//! the TokenReview returned), as controller-runtime's `WithAuthenticationAndAuthorization`
//! filter and kube-rbac-proxy decide. Both reviews are made with the operator's own client (its
//! ClusterRole may `create` tokenreviews and subjectaccessreviews).
//!
//! Decisions are cached by the token's SHA-256 (never the token itself) for a short time, so a
//! Prometheus scraping every 15 s costs the API server two reviews per [`ALLOWED_TTL`], not two per
//! scrape; a refusal is kept shorter ([`DENIED_TTL`]) so that a new RoleBinding takes effect soon.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};

/// The non-resource URL a scraper must be allowed to `get`.
pub const METRICS_PATH: &str = "/metrics";
/// How long an allowed token stays allowed without a new review.
pub const ALLOWED_TTL: Duration = Duration::from_secs(30);
/// How long a refused token (401 or 403) stays refused without a new review.
pub const DENIED_TTL: Duration = Duration::from_secs(10);
/// At most this many cached decisions (a flood of made-up tokens cannot grow memory).
const MAX_CACHED: usize = 1024;

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

/// The token of an `Authorization: Bearer <token>` header value (scheme case-insensitive).
pub fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Decisions by token hash, each with when it was made.
#[derive(Debug, Default)]
pub struct DecisionCache {
    entries: HashMap<[u8; 32], (Instant, Decision)>,
}

impl DecisionCache {
    fn ttl(d: Decision) -> Duration {
        if d == Decision::Allowed {
            ALLOWED_TTL
        } else {
            DENIED_TTL
        }
    }

    /// The decision for `key` made less than its TTL before `now`.
    pub fn get(&self, key: &[u8; 32], now: Instant) -> Option<Decision> {
        let (at, d) = self.entries.get(key)?;
        (now.saturating_duration_since(*at) < Self::ttl(*d)).then_some(*d)
    }

    pub fn put(&mut self, key: [u8; 32], d: Decision, now: Instant) {
        if self.entries.len() >= MAX_CACHED {
            self.entries
                .retain(|_, (at, d)| now.saturating_duration_since(*at) < Self::ttl(*d));
            if self.entries.len() >= MAX_CACHED {
                self.entries.clear();
            }
        }
        self.entries.insert(key, (now, d));
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Reviews scrapers' tokens with the API server.
pub struct Authorizer {
    client: kube::Client,
    cache: Mutex<DecisionCache>,
}

impl std::fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authorizer").finish_non_exhaustive()
    }
}

impl Authorizer {
    pub fn new(client: kube::Client) -> Self {
        Authorizer {
            client,
            cache: Mutex::new(DecisionCache::default()),
        }
    }

    /// Whether `token` may scrape: cached, or a TokenReview then a SubjectAccessReview. An error
    /// (the API server unreachable, or the operator not allowed to review) is not cached.
    pub async fn check(&self, token: &str) -> Result<Decision, kube::Error> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(d) = self.cache.lock().unwrap().get(&key, Instant::now()) {
            return Ok(d);
        }
        let d = self.review(token).await?;
        self.cache.lock().unwrap().put(key, d, Instant::now());
        Ok(d)
    }

    async fn review(&self, token: &str) -> Result<Decision, kube::Error> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone())
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
        let reviewed = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &access)
            .await?;
        Ok(if reviewed.status.is_some_and(|s| s.allowed) {
            Decision::Allowed
        } else {
            Decision::Forbidden
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_header() {
        assert_eq!(bearer_token("Bearer abc.def"), Some("abc.def"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic dXNlcjpwdw=="), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
    }

    #[test]
    fn decisions_expire_refusals_sooner_and_the_cache_stays_bounded() {
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

        // Made-up tokens: expired entries go first, then everything, never past the bound.
        for i in 0..3 * MAX_CACHED {
            let mut k = [0; 32];
            k[..8].copy_from_slice(&(i as u64).to_le_bytes());
            c.put(k, Decision::Unauthenticated, later);
            assert!(c.len() <= MAX_CACHED);
        }
        assert!(!c.is_empty());
    }
}
