//! kube-apiserver's own count of the writes it served (`apiserver_request_total`, write verbs),
//! by group, resource, subresource, verb and response code: what the benchmark reports per phase
//! and what the tests' "nothing written at rest" checks compare. A server-side apply that changes
//! nothing keeps the object's resourceVersion, so only these counters see a redundant write.

use std::collections::BTreeMap;

use kube::Client;
use kube::api::GetParams;

/// The verbs that write.
pub const WRITE_VERBS: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// One counter: (group, resource, subresource, verb, code).
pub type Key = (String, String, String, String, String);

/// Write requests served so far, per [`Key`].
pub type Counts = BTreeMap<Key, f64>;

/// Reads the write counters from kube-apiserver's `/metrics` (the client must be allowed to
/// `get` the non-resource URL: the test cluster's admin is).
pub async fn write_counts(client: &Client) -> anyhow::Result<Counts> {
    let req = kube::core::Request::new("").get("metrics", &GetParams::default())?;
    let text = client.request_text(req).await?;
    Ok(parse_write_counts(&text))
}

/// The write counters of a Prometheus text exposition.
pub fn parse_write_counts(text: &str) -> Counts {
    let mut out = Counts::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let mut m: BTreeMap<&str, &str> = BTreeMap::new();
        for kv in labels.split("\",") {
            if let Some((k, v)) = kv.split_once("=\"") {
                m.insert(k, v.trim_end_matches('"'));
            }
        }
        let verb = m.get("verb").copied().unwrap_or("");
        // A dry run (the operator's fence check) writes nothing.
        if !WRITE_VERBS.contains(&verb) || m.get("dry_run").is_some_and(|d| !d.is_empty()) {
            continue;
        }
        let get = |k: &str| m.get(k).copied().unwrap_or("").to_string();
        let key = (
            get("group"),
            get("resource"),
            get("subresource"),
            verb.to_string(),
            get("code"),
        );
        *out.entry(key).or_default() += value.trim().parse::<f64>().unwrap_or(0.0);
    }
    out
}

/// What moved between two reads.
pub fn diff(after: &Counts, before: &Counts) -> Counts {
    let mut d = Counts::new();
    for (k, v) in after {
        let x = v - before.get(k).copied().unwrap_or(0.0);
        if x > 0.5 {
            d.insert(k.clone(), x);
        }
    }
    d
}

/// A difference as lines `VERB group/resource[/subresource] code: n`, for messages.
pub fn describe(d: &Counts) -> Vec<String> {
    d.iter()
        .map(|((g, r, s, verb, code), n)| {
            let what = [g.as_str(), r.as_str(), s.as_str()]
                .into_iter()
                .filter(|x| !x.is_empty())
                .collect::<Vec<_>>()
                .join("/");
            format!("{verb} {what} {code}: {n}")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_write_verbs_only_and_sums_per_key() {
        let text = "\
# HELP apiserver_request_total x
apiserver_request_total{code=\"200\",component=\"apiserver\",dry_run=\"\",group=\"\",resource=\"nodes\",scope=\"resource\",subresource=\"\",verb=\"PATCH\",version=\"v1\"} 3
apiserver_request_total{code=\"200\",component=\"apiserver\",dry_run=\"\",group=\"\",resource=\"nodes\",scope=\"resource\",subresource=\"\",verb=\"GET\",version=\"v1\"} 9
apiserver_request_total{code=\"200\",component=\"apiserver\",dry_run=\"All\",group=\"\",resource=\"nodes\",scope=\"resource\",subresource=\"\",verb=\"PATCH\",version=\"v1\"} 5
apiserver_request_total{code=\"201\",component=\"apiserver\",dry_run=\"\",group=\"gpusharing.io\",resource=\"gpusharingpolicies\",scope=\"resource\",subresource=\"status\",verb=\"APPLY\",version=\"v1alpha1\"} 2
";
        let c = parse_write_counts(text);
        assert_eq!(c.len(), 2);
        let before = Counts::from([(
            (
                String::new(),
                "nodes".into(),
                String::new(),
                "PATCH".into(),
                "200".into(),
            ),
            1.0,
        )]);
        assert_eq!(
            describe(&diff(&c, &before)),
            [
                "PATCH nodes 200: 2",
                "APPLY gpusharing.io/gpusharingpolicies/status 201: 2"
            ]
        );
    }
}
