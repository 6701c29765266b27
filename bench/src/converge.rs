//! Waiting for the cluster: every node labelled and every policy Ready, quiet API writes, an
//! idle process.

use super::*;

/// Polls until every policy in `which` is Ready with all its nodes applied (and, for `edited`,
/// observed the new generation with a new key), then checks the node labels themselves.
/// Returns the elapsed time since `start`, or None on timeout.
pub(crate) async fn wait_converged(
    client: &Client,
    per_group: &[i32],
    old_keys: &BTreeMap<String, String>,
    start: Instant,
    timeout: Duration,
) -> anyhow::Result<Option<Duration>> {
    let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let p = per_group.len();
    loop {
        if start.elapsed() > timeout {
            return Ok(None);
        }
        let list = pol.list(&ListParams::default()).await?;
        let mut keys: BTreeMap<String, String> = BTreeMap::new();
        let mut ok = list.items.len() == p;
        for item in &list.items {
            let name = item.name_any();
            let g: usize = name
                .trim_start_matches("bench-")
                .parse()
                .unwrap_or(usize::MAX);
            let Some(s) = &item.status else {
                ok = false;
                break;
            };
            let ready = s
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let gen_ok = s.observed_generation == item.metadata.generation;
            let want = per_group.get(g).copied().unwrap_or(-1);
            let key = s.device_config_key.clone().unwrap_or_default();
            let key_new = old_keys.get(&name).is_none_or(|k| *k != key);
            if !(ready && gen_ok && key_new && s.applied_nodes == want && s.matched_nodes == want)
                || key.is_empty()
            {
                ok = false;
                break;
            }
            keys.insert(name, key);
        }
        if ok {
            let elapsed = start.elapsed();
            // Verify the labels on the nodes themselves.
            let meta = nodes.list_metadata(&ListParams::default()).await?;
            let bad = meta
                .items
                .iter()
                .filter(|n: &&PartialObjectMeta<Node>| {
                    let l = n.labels();
                    let Some(g) = l.get(GROUP_LABEL) else {
                        return false;
                    };
                    let pname = policy_name(g.trim_start_matches('g').parse().unwrap_or(0));
                    l.get(LABEL_POLICY) != Some(&pname)
                        || l.get(LABEL_DEVICE_PLUGIN_CONFIG) != keys.get(&pname)
                })
                .count();
            if bad == 0 {
                return Ok(Some(elapsed));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the operator's writes stop (no change of the write counters for `quiet`).
pub(crate) async fn wait_quiet(
    client: &Client,
    quiet: Duration,
    max: Duration,
) -> anyhow::Result<Counts> {
    let start = Instant::now();
    let mut last = scrape(client).await?;
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = scrape(client).await?;
        let relevant = |c: &Counts| -> f64 {
            c.iter()
                .filter(|(k, _)| k.0 != "coordination.k8s.io")
                .map(|(_, v)| v)
                .sum()
        };
        if relevant(&now) != relevant(&last) {
            since = Instant::now();
            last = now;
        } else if since.elapsed() >= quiet || start.elapsed() >= max {
            return Ok(now);
        }
    }
}

/// Waits until kube-local (apiserver, etcd, its garbage collector digesting the new nodes) is
/// idle: under 10% of a core for two consecutive seconds, at most `max`.
pub(crate) async fn wait_idle(pid: u32, max: Duration) {
    let start = Instant::now();
    let mut calm = 0;
    let mut last = proc_stats(pid).cpu_s;
    while start.elapsed() < max && calm < 2 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = proc_stats(pid).cpu_s;
        calm = if now - last < 0.1 { calm + 1 } else { 0 };
        last = now;
    }
}
