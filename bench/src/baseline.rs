//! The baseline: the minimal writes (device-plugin ConfigMap, ClusterPolicy, one label apply per
//! node, one status apply per policy) computed with the same planner and issued directly.

use super::*;

pub(crate) struct BaselineResult {
    pub(crate) time: Duration,
    pub(crate) writes: i64,
}

pub(crate) async fn run_baseline(
    args: &Args,
    kl: &Path,
    n: usize,
    p: usize,
) -> anyhow::Result<BaselineResult> {
    let cluster = start_cluster(
        kl,
        &args
            .out
            .join(format!("logs/{n}x{p}-baseline-kube-local.log")),
    )
    .await?;
    let client = cluster.client.clone();
    let res = async {
        install_crd(&client).await?;
        create_nodes(&client, n, p, args.concurrency).await?;
        create_policies(&client, p, args.concurrency).await?;
        // Plan with the same planner the operator uses, outside the timed part.
        let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
        let policies = pol.list(&ListParams::default()).await?.items;
        let nodes_api: Api<Node> = Api::all(client.clone());
        let mut facts: Vec<NodeFacts> = nodes_api
            .list_metadata(&ListParams::default())
            .await?
            .items
            .into_iter()
            .map(|n| NodeFacts {
                name: n.name_any(),
                labels: n.labels().clone().into(),
                ..Default::default()
            })
            .collect();
        facts.sort_by(|a, b| a.name.cmp(&b.name));
        let mut first_input = PlanInput::new(policies.clone(), facts.clone());
        first_input.cluster.now = k8s_openapi::jiff::Timestamp::now().as_second();
        let first = plan::plan(&first_input);
        // Statuses as they are once the labels are in place.
        for f in &mut facts {
            if let Some(want) = first.node_labels.get(&f.name) {
                f.labels.extend(want.clone());
                f.owned = want.keys().map(str::to_string).collect();
            }
        }
        let mut input = PlanInput::new(policies.clone(), facts);
        input.cluster.current_device_config = first.device_config.clone();
        let done = plan::plan(&input);
        // The same node metadata the operator writes: our labels and annotations.
        let label_patches: Vec<(String, serde_json::Value)> = first
            .node_labels
            .iter()
            .filter(|(_, l)| !l.is_empty())
            .map(|(k, v)| {
                let a = first.node_annotations.get(k).cloned().unwrap_or_default();
                (k.to_string(), json!({"labels": v, "annotations": a}))
            })
            .collect();
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let statuses: Vec<(String, serde_json::Value)> = done
            .statuses
            .iter()
            .map(|(name, s)| {
                let mut v = serde_json::to_value(s).unwrap();
                if let Some(cs) = v.get_mut("conditions").and_then(|c| c.as_array_mut()) {
                    for c in cs {
                        c["lastTransitionTime"] = json!(now);
                    }
                }
                (name.clone(), v)
            })
            .collect();
        let cm = plan::configmap(names::DEVICE_PLUGIN_CONFIGMAP, NAMESPACE, "device-plugin", &first.device_config);
        let cp_obj = json!({
            "apiVersion": "nvidia.com/v1",
            "kind": "ClusterPolicy",
            "metadata": {"name": "cluster-policy"},
            "spec": first.cluster_policy_spec,
        });

        wait_idle(cluster.pid(), Duration::from_secs(60)).await;
        let before = scrape(&client).await?;
        let pp = PatchParams::apply(MANAGER).force();
        let start = Instant::now();
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
        cms.patch(names::DEVICE_PLUGIN_CONFIGMAP, &pp, &Patch::Apply(&cm)).await?;
        let cps: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
        cps.patch("cluster-policy", &pp, &Patch::Apply(&cp_obj)).await?;
        stream::iter(label_patches)
            .map(|(name, labels)| {
                let api = nodes_api.clone();
                let pp = pp.clone();
                async move {
                    let mut meta = labels;
                    meta["name"] = json!(name);
                    let obj = json!({"apiVersion": "v1", "kind": "Node", "metadata": meta});
                    api.patch(&name, &pp, &Patch::Apply(&obj)).await?;
                    Ok::<_, anyhow::Error>(())
                }
            })
            .buffer_unordered(args.concurrency)
            .try_collect::<Vec<_>>()
            .await?;
        stream::iter(statuses)
            .map(|(name, status)| {
                let api = pol.clone();
                let pp = pp.clone();
                async move {
                    let obj = json!({"apiVersion": "gpusharing.io/v1alpha1", "kind": "GpuSharingPolicy", "status": status});
                    api.patch_status(&name, &pp, &Patch::Apply(&obj)).await?;
                    Ok::<_, anyhow::Error>(())
                }
            })
            .buffer_unordered(args.concurrency)
            .try_collect::<Vec<_>>()
            .await?;
        let time = start.elapsed();
        let after = scrape(&client).await?;
        let w = Writes::from(&diff(&after, &before), 0);
        Ok::<_, anyhow::Error>(BaselineResult { time, writes: w.core() })
    }
    .await;
    drop(cluster); // kube-local stops, its directory is removed
    res
}
