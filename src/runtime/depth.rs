//! The operator's Kubernetes client, with one guard: JSON nested deeper than [`MAX_DEPTH`] in a
//! GpuSharingPolicy is cut before kube parses it.
//!
//! A policy's `devices` fields keep any JSON value (no structural schema can type "`all` or a
//! list"), and the API server accepts nesting up to 10,000 levels. serde_json refuses more than
//! 128, and kube parses a whole list (or watch event) at once: one policy nested 200 deep would
//! fail every list of policies, and the operator would read none, for every policy's nodes.
//! Responses about GpuSharingPolicies go through [`Cap`], a byte-level pass that replaces any
//! array or object opened deeper than [`MAX_DEPTH`] with `null`. The policy then reads, with
//! its `devices` refused by validation naming the field, and the others are unaffected. No
//! legitimate policy comes near the limit (its deepest fields, managed fields included, are
//! about a dozen levels down).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use kube::client::{Body, ClientBuilder};

/// Arrays and objects nested deeper than this are replaced with `null`.
pub const MAX_DEPTH: u32 = 64;

/// The path segment of the requests whose responses are capped.
const POLICIES: &str = "/gpusharingpolicies";

/// The operator's client: `config`'s default stack, GpuSharingPolicy responses capped.
pub fn client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&CapLayer)
        .build())
}

/// The streaming state of the pass over one response body: the current nesting depth, whether
/// inside a string (and after a backslash in it), and, while a too-deep value is being dropped,
/// the depth it was opened at.
#[derive(Debug, Default, Clone)]
pub struct Cap {
    depth: u32,
    in_string: bool,
    escaped: bool,
    dropping: Option<u32>,
}

impl Cap {
    /// Passes `input` (the next bytes of the body) to `out`, dropping too-deep values.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) {
        for &b in input {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                if self.dropping.is_none() {
                    out.push(b);
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'[' | b'{' => {
                    self.depth += 1;
                    if self.dropping.is_none() && self.depth > MAX_DEPTH {
                        self.dropping = Some(self.depth);
                        out.extend_from_slice(b"null");
                    }
                }
                b']' | b'}' => {
                    let closing = self.depth;
                    self.depth = self.depth.saturating_sub(1);
                    if self.dropping == Some(closing) {
                        self.dropping = None;
                        continue;
                    }
                }
                _ => {}
            }
            if self.dropping.is_none() {
                out.push(b);
            }
        }
    }
}

/// A response body passed through [`Cap`] (or untouched).
pub struct CapBody<B> {
    inner: B,
    cap: Option<Cap>,
}

impl<B> HttpBody for CapBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let Some(cap) = this.cap.as_mut() else {
            return polled;
        };
        polled.map(|frame| {
            frame.map(|f| {
                f.map(|f| {
                    f.map_data(|data| {
                        let mut out = Vec::with_capacity(data.len());
                        cap.feed(&data, &mut out);
                        Bytes::from(out)
                    })
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.cap.is_some() {
            // Dropping changes the length.
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

/// Caps the bodies of GpuSharingPolicy responses.
#[derive(Clone, Copy, Debug)]
pub struct CapLayer;

impl<S> tower::Layer<S> for CapLayer {
    type Service = CapService<S>;

    fn layer(&self, inner: S) -> CapService<S> {
        CapService { inner }
    }
}

#[derive(Clone, Debug)]
pub struct CapService<S> {
    inner: S,
}

impl<S, B> tower::Service<Request<Body>> for CapService<S>
where
    S: tower::Service<Request<Body>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Response = Response<CapBody<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let capped = req.uri().path().contains(POLICIES);
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|inner| CapBody {
                inner,
                cap: capped.then(Cap::default),
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// JSON values of any shape, strings full of the bytes the pass must not take for
    /// structure (brackets, quotes, backslashes, multi-byte characters).
    fn json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            "[\\[\\]{}\"\\\\a-z\u{e9}\u{1f600} ,:]{0,12}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(8, 64, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                prop::collection::btree_map("[a-z\\[\"]{0,4}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any document, cut in any chunks, comes out as JSON that serde_json reads; as it
        /// was when no more than `MAX_DEPTH` deep, and with its deep parts `null` otherwise.
        #[test]
        fn the_pass_keeps_json_valid(v in json(), wrap in 0usize..140, chunk in 1usize..64) {
            let doc = (0..wrap).fold(v.clone(), |v, _| serde_json::Value::Array(vec![v]));
            let text = serde_json::to_string(&doc).unwrap();
            let out = capped(&text, chunk);
            let read: serde_json::Value = serde_json::from_str(&out).unwrap();
            if wrap + 8 <= MAX_DEPTH as usize {
                prop_assert_eq!(read, doc);
            }
        }
    }

    proptest! {
        /// One policy with any `devices` value (any shape, nested up to 300 deep) in a list
        /// between two valid ones: after the pass the list reads as typed policies, kube's
        /// way (one `ObjectList` at once), and the valid ones are intact.
        #[test]
        fn one_hostile_policy_never_stops_the_others_reading(
            v in json(),
            wrap in 0usize..300,
            chunk in 1usize..512,
        ) {
            use crate::api::crd::GpuSharingPolicy;
            let devices = (0..wrap).fold(v, |v, _| serde_json::Value::Array(vec![v]));
            let item = |name: &str, devices: serde_json::Value| serde_json::json!({
                "apiVersion": "gpusharing.io/v1alpha1",
                "kind": "GpuSharingPolicy",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {},
                    "strategy": "mig",
                    "mig": {"migStrategy": "single", "customLayout": [{"migEnabled": true, "devices": devices,
                                              "migDevices": {"1g.10gb": 7}}]},
                },
            });
            let list = serde_json::json!({
                "apiVersion": "gpusharing.io/v1alpha1",
                "kind": "GpuSharingPolicyList",
                "metadata": {},
                "items": [item("a", "all".into()), item("hostile", devices), item("b", "all".into())],
            });
            let text = serde_json::to_string(&list).unwrap();
            // Written through serde_json, which nests without limit; the API server would
            // serve it the same (it accepts 10,000 levels).
            let out = capped(&text, chunk);
            let read: kube::core::ObjectList<GpuSharingPolicy> = serde_json::from_str(&out)
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let names: Vec<_> = read.items.iter().map(|p| p.metadata.name.clone().unwrap()).collect();
            prop_assert_eq!(names, ["a", "hostile", "b"]);
            for p in [&read.items[0], &read.items[2]] {
                let (errors, _) = crate::validate::validate("a", &p.spec);
                prop_assert!(errors.is_empty(), "{:?}", errors);
            }
        }
    }

    fn capped(input: &str, chunk: usize) -> String {
        let mut cap = Cap::default();
        let mut out = Vec::new();
        for c in input.as_bytes().chunks(chunk.max(1)) {
            cap.feed(c, &mut out);
        }
        String::from_utf8(out).unwrap()
    }

    fn nested(depth: usize) -> String {
        format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
    }

    #[test]
    fn shallow_json_passes_unchanged_in_any_chunks() {
        let doc = r#"{"a":[1,{"b":"x]}[{\"y\\"}],"c":{"d":[]}}"#;
        for chunk in 1..doc.len() {
            assert_eq!(capped(doc, chunk), doc);
        }
        let deep_enough = nested(MAX_DEPTH as usize);
        assert_eq!(capped(&deep_enough, 3), deep_enough);
    }

    #[test]
    fn values_opened_too_deep_become_null_and_the_rest_reads() {
        let deep = nested(300);
        let doc = format!(
            "{{\"items\":[{{\"spec\":{{\"devices\":{deep}}}}},{{\"spec\":{{\"devices\":\"all\"}}}}]}}\n{{\"next\":\"line\"}}"
        );
        for chunk in [1, 7, 4096] {
            let out = capped(&doc, chunk);
            let mut lines = out.lines();
            let v: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
            assert_eq!(v["items"][1]["spec"]["devices"], "all");
            // Depth 64 is kept: the document, `items`, the item and `spec` are 4 levels above
            // the arrays of `devices`.
            let mut d = &v["items"][0]["spec"]["devices"];
            let mut levels = 4;
            while let Some(inner) = d.get(0) {
                d = inner;
                levels += 1;
            }
            assert!(d.is_null(), "{d}");
            assert_eq!(levels, MAX_DEPTH as usize);
            assert_eq!(lines.next(), Some("{\"next\":\"line\"}"));
        }
        // serde_json alone refuses it.
        assert!(serde_json::from_str::<serde_json::Value>(doc.lines().next().unwrap()).is_err());
    }
}
