//! Offline rendering: read policies (and optionally nodes) from files, plan, and print every
//! object the operator would write as multi-document YAML.
//!
//! The output is an interface (documented in docs/plan-and-render.md, parsed by the conformance test):
//! the device-plugin ConfigMap; the mig-parted ConfigMap (only with custom MIG layouts); the
//! ClusterPolicy patch; ResourceClaimTemplates of DRA policies; with nodes, one Node document
//! each with the labels the operator manages on it; one GpuSharingPolicy document per policy
//! with its computed status.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::DynamicObject;
use serde_json::json;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{INSTANCE_TYPES_CONFIGMAP, MANAGER};
use crate::nvidia::MIG_PARTED_KEY;
use crate::observe::karpenter::KarpenterView;
use crate::observe::node::{Interner, facts};
use crate::observe::{self, ClusterView, Memory, Settings};
use crate::plan::{self, LabelFilter, NodeFacts, Plan, PlanInput, configmap};
use crate::validate::{self, FieldError};

fn policy_error(name: &str, path: impl Into<String>, message: impl Into<String>) -> RenderError {
    RenderError::Policy {
        name: name.to_string(),
        error: FieldError {
            path: path.into(),
            message: message.into(),
        },
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid YAML: {source}")]
    Yaml {
        path: PathBuf,
        source: Box<serde_saphyr::Error>,
    },
    /// A policy field that is wrong, as validation (or the planner) found it.
    #[error("policy {name:?}: {error}")]
    Policy { name: String, error: FieldError },
    /// What the CRD's CEL rules (evaluated locally) reject.
    #[error("policy {name:?}: CEL validation: {message}")]
    Cel { name: String, message: String },
    #[error("{path}: {message}")]
    Input { path: PathBuf, message: String },
}

fn yaml_files(path: &Path) -> Result<Vec<PathBuf>, RenderError> {
    let io = |source| RenderError::Io {
        path: path.to_path_buf(),
        source,
    };
    if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
            .collect();
        files.sort();
        Ok(files)
    } else {
        Ok(vec![path.to_path_buf()])
    }
}

fn documents(path: &Path) -> Result<Vec<serde_json::Value>, RenderError> {
    let mut docs = Vec::new();
    for file in yaml_files(path)? {
        let text = std::fs::read_to_string(&file).map_err(|source| RenderError::Io {
            path: file.clone(),
            source,
        })?;
        docs.extend(text_documents(&text, &file)?);
    }
    Ok(docs)
}

/// The documents of one YAML text (`origin` names it in errors); lists (kind: List, NodeList)
/// are flattened.
fn text_documents(text: &str, origin: &Path) -> Result<Vec<serde_json::Value>, RenderError> {
    let parsed: Vec<serde_json::Value> =
        crate::api::yaml::documents(text).map_err(|source| RenderError::Yaml {
            path: origin.to_path_buf(),
            source: Box::new(source),
        })?;
    let mut docs = Vec::new();
    for v in parsed.into_iter().filter(|v| !v.is_null()) {
        match v.get("items").and_then(|i| i.as_array()) {
            Some(items) => docs.extend(items.iter().cloned()),
            None => docs.push(v),
        }
    }
    Ok(docs)
}

/// Keys present in `input` that did not survive the typed round trip: fields we do not know.
/// NVIDIA's parsers silently ignore unknown keys; we refuse them instead.
fn unknown_fields(
    input: &serde_json::Value,
    typed: &serde_json::Value,
    path: &str,
    out: &mut Vec<String>,
) {
    match (input, typed) {
        (serde_json::Value::Object(m), serde_json::Value::Object(o)) => {
            for (k, v) in m {
                let p = if path.is_empty() {
                    k.to_string()
                } else {
                    format!("{path}.{k}")
                };
                match o.get(k) {
                    Some(t) => unknown_fields(v, t, &p, out),
                    None => {
                        let empty = v.is_null()
                            || v.as_array().is_some_and(|s| s.is_empty())
                            || v.as_object().is_some_and(|s| s.is_empty())
                            || v.as_bool() == Some(false);
                        if !empty {
                            out.push(p);
                        }
                    }
                }
            }
        }
        (serde_json::Value::Array(a), serde_json::Value::Array(b)) => {
            for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
                unknown_fields(x, y, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// The CRD's CEL rules on one policy, evaluated locally (what the API server would reject;
/// rules this CEL build cannot evaluate are left to it).
/// As kube's `validate_cel`, with the CRD's schema generated once instead of on every call
/// (generating it was a third of a fuzz input's time).
fn validate_cel(p: &GpuSharingPolicy) -> Result<(), kube::core::cel::ValidationErrors> {
    use kube::CustomResourceExt;
    static SCHEMA: std::sync::LazyLock<serde_json::Value> = std::sync::LazyLock::new(|| {
        let crd = GpuSharingPolicy::crd();
        let schema = crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("the derived CRD has an openAPIV3Schema");
        serde_json::to_value(schema).expect("the schema serializes")
    });
    let object = serde_json::to_value(p).expect("a policy serializes");
    // A rule this CEL build cannot evaluate (kube-cel 0.8 lacks `type()`, which the
    // `rollout.maxUnavailable` rule uses) is left to the API server, not held against the file.
    match kube::core::cel::Validator::new().validate(&SCHEMA, &object, None) {
        Ok(()) => Ok(()),
        Err(e) => {
            let kept: Vec<_> = e
                .into_vec()
                .into_iter()
                .filter(|x| x.kind != kube::core::cel::ErrorKind::UnsupportedReference)
                .collect();
            if kept.is_empty() {
                Ok(())
            } else {
                Err(kept.into())
            }
        }
    }
}

/// The field a deserialization error is about. serde reports a missing field at its parent
/// (`.` for a missing `spec`), with the name only in the message: the path then names it
/// (found by the `policy_yaml` fuzz target).
fn serde_field_error(e: serde_path_to_error::Error<serde_json::Error>) -> (String, String) {
    let path = e.path().to_string();
    let message = e.into_inner().to_string();
    let missing = message
        .strip_prefix("missing field `")
        .and_then(|r| r.split('`').next());
    match missing {
        Some(field) if path == "." || path.is_empty() => (field.to_string(), message),
        Some(field) => (format!("{path}.{field}"), message),
        None => (path, message),
    }
}

/// Reads and validates the policies in a file or directory. Every invalid policy is an error
/// naming the policy and the field.
pub fn load_policies(path: &Path) -> Result<Vec<GpuSharingPolicy>, Vec<RenderError>> {
    policies_of(documents(path).map_err(|e| vec![e])?)
}

/// [`load_policies`] of a YAML text; `origin` names it in YAML errors.
pub fn policies_from_text(
    text: &str,
    origin: &Path,
) -> Result<Vec<GpuSharingPolicy>, Vec<RenderError>> {
    policies_of(text_documents(text, origin).map_err(|e| vec![e])?)
}

fn policies_of(docs: Vec<serde_json::Value>) -> Result<Vec<GpuSharingPolicy>, Vec<RenderError>> {
    let mut policies = Vec::new();
    let mut errors = Vec::new();
    for d in docs {
        if d.get("kind").and_then(|k| k.as_str()) != Some("GpuSharingPolicy") {
            continue;
        }
        let name = d
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(|n| n.as_str())
            .unwrap_or("<unnamed>")
            .to_string();
        let api_version = d
            .get("apiVersion")
            .and_then(|a| a.as_str())
            .unwrap_or_default();
        if api_version != "gpusharing.io/v1alpha1" {
            errors.push(policy_error(
                &name,
                "apiVersion",
                format!("expected gpusharing.io/v1alpha1, got {api_version:?}"),
            ));
            continue;
        }
        let p: GpuSharingPolicy = match serde_path_to_error::deserialize(d.clone()) {
            Ok(p) => p,
            Err(e) => {
                let (path, message) = serde_field_error(e);
                errors.push(policy_error(&name, path, message));
                continue;
            }
        };
        if policies
            .iter()
            .any(|q: &GpuSharingPolicy| q.metadata.name.as_deref() == Some(name.as_str()))
        {
            errors.push(policy_error(
                &name,
                "metadata.name",
                "defined more than once (a later definition would silently replace the first)",
            ));
            continue;
        }
        let typed = serde_json::to_value(&p).expect("serializable");
        let mut unknown = Vec::new();
        unknown_fields(&d, &typed, "", &mut unknown);
        for u in unknown.iter().filter(|u| u.starts_with("spec")) {
            errors.push(policy_error(
                &name,
                u.as_str(),
                "unknown field (NVIDIA's parsers silently ignore unknown keys; we do not)",
            ));
        }
        let (errs, _) = validate::validate(&name, &p.spec);
        for error in errs {
            errors.push(RenderError::Policy {
                name: name.clone(),
                error,
            });
        }
        // The CRD's CEL rules, evaluated locally: what the API server would reject.
        if let Err(e) = validate_cel(&p) {
            let known: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            if known
                .iter()
                .all(|k| !k.contains(&format!("policy {name:?}")))
            {
                errors.push(RenderError::Cel {
                    name: name.clone(),
                    message: e.to_string(),
                });
            }
        }
        policies.push(p);
    }
    if errors.is_empty() {
        Ok(policies)
    } else {
        Err(errors)
    }
}

/// Reads nodes (Node objects, or a NodeList) from a file.
pub fn load_nodes(path: &Path) -> Result<Vec<NodeFacts>, RenderError> {
    nodes_of(documents(path)?, path)
}

/// [`load_nodes`] of a YAML text; `origin` names it in errors.
pub fn nodes_from_text(text: &str, origin: &Path) -> Result<Vec<NodeFacts>, RenderError> {
    nodes_of(text_documents(text, origin)?, origin)
}

/// The Node documents as the planner sees them: the same conversion as the controller's node
/// cache ([`crate::observe::node::facts`]): labels, our annotations, the field manager's
/// ownership when the file carries managedFields (`kubectl get -o yaml --show-managed-fields`),
/// and the allocatable of NVIDIA's resources.
fn nodes_of(docs: Vec<serde_json::Value>, path: &Path) -> Result<Vec<NodeFacts>, RenderError> {
    let mut nodes = Vec::new();
    let mut strings = Interner::default();
    for d in docs {
        if d.get("kind").and_then(|k| k.as_str()) != Some("Node") {
            continue;
        }
        let name = d
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(|n| n.as_str())
            .ok_or_else(|| RenderError::Input {
                path: path.to_path_buf(),
                message: "a Node without metadata.name".into(),
            })?
            .to_string();
        let node: Node = serde_path_to_error::deserialize(d).map_err(|e| RenderError::Input {
            path: path.to_path_buf(),
            message: format!("node {name}: {}: {}", e.path(), e.inner()),
        })?;
        let all = LabelFilter::everything();
        nodes.push(facts(node, MANAGER, &all, &mut strings));
    }
    Ok(nodes)
}

/// All documents of the render output.
pub fn documents_of(
    plan: &Plan,
    input: &PlanInput,
    namespace: &str,
    with_nodes: bool,
) -> Vec<serde_json::Value> {
    let mut out = vec![configmap(
        &input.settings.device_configmap,
        namespace,
        "device-plugin",
        &plan.device_config,
    )];
    if let Some(m) = &plan.mig_config {
        let mut data = BTreeMap::new();
        data.insert(MIG_PARTED_KEY.to_string(), m.clone());
        out.push(configmap(
            &input.settings.mig_configmap,
            namespace,
            "mig-parted",
            &data,
        ));
    }
    if let Some(v) = &plan.vgpu_config {
        let mut data = BTreeMap::new();
        data.insert(crate::nvidia::vgpu::VGPU_KEY.to_string(), v.clone());
        out.push(configmap(
            &input.settings.vgpu_configmap,
            namespace,
            "vgpu-devices",
            &data,
        ));
    }
    out.push(json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy"},
        "spec": plan.cluster_policy_spec,
    }));
    out.extend(plan.claim_templates.values().cloned());
    out.extend(plan.device_classes.values().cloned());
    out.extend(plan.node_overlays.values().cloned());
    if with_nodes {
        for (name, labels) in &plan.node_labels {
            out.push(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}));
        }
    }
    for p in &input.policies {
        let name = p.name_any();
        if let Some(s) = plan.statuses.get(&name) {
            out.push(json!({
                "apiVersion": "gpusharing.io/v1alpha1",
                "kind": "GpuSharingPolicy",
                "metadata": {"name": name},
                "status": s,
            }));
        }
    }
    out
}

/// How to render.
#[derive(Debug, Clone)]
pub struct RenderOptions {
    /// The GPU Operator's namespace (where our ConfigMaps go).
    pub namespace: String,
    /// Named mig-parted layouts (the GPU Operator's default config).
    pub base_mig_configs: BTreeMap<String, serde_json::Value>,
    /// With nodes: show the first pass only, not the converged result.
    pub single_pass: bool,
    /// Karpenter's NodePools and NodeOverlays, and the instance-type table ConfigMap, as
    /// documents (`--karpenter`): the policies' NodeOverlays are rendered too.
    pub karpenter: Option<Vec<serde_json::Value>>,
}

/// What `render` prints: the YAML, and a summary for stderr.
#[derive(Debug)]
pub struct Rendered {
    pub text: String,
    /// Passes until convergence (with nodes and not `single_pass`).
    pub passes: Option<usize>,
}

/// The field errors the planner found, as render errors.
fn planner_errors(plan: &Plan) -> Vec<RenderError> {
    plan.invalid
        .iter()
        .flat_map(|(name, errs)| {
            errs.iter().map(|e| RenderError::Policy {
                name: name.clone(),
                error: e.clone(),
            })
        })
        .collect()
}

/// Every document of a file or directory (for `--karpenter`).
pub fn load_documents(path: &Path) -> Result<Vec<serde_json::Value>, RenderError> {
    documents(path)
}

/// NodePools, NodeOverlays, and the instance-type table ConfigMap (name, data).
type KarpenterDocs = (
    Vec<DynamicObject>,
    Vec<DynamicObject>,
    Option<(String, BTreeMap<String, String>)>,
);

/// NodePools and NodeOverlays among `docs`, and the data of the instance-type table ConfigMap.
fn karpenter_objects(docs: Option<&[serde_json::Value]>) -> KarpenterDocs {
    let (mut pools, mut overlays, mut table) = (Vec::new(), Vec::new(), None);
    for d in docs.into_iter().flatten() {
        let kind = d.get("kind").and_then(|k| k.as_str());
        let name = d["metadata"]["name"].as_str();
        match kind {
            Some("NodePool" | "NodeOverlay") => {
                if let Ok(o) = serde_json::from_value::<DynamicObject>(d.clone()) {
                    if kind == Some("NodePool") {
                        pools.push(o);
                    } else {
                        overlays.push(o);
                    }
                }
            }
            Some("ConfigMap") if name == Some(INSTANCE_TYPES_CONFIGMAP) => {
                let data = serde_json::from_value(d["data"].clone()).unwrap_or_default();
                table = Some((INSTANCE_TYPES_CONFIGMAP.to_string(), data));
            }
            _ => {}
        }
    }
    (pools, overlays, table)
}

/// Renders to multi-document YAML text; policies the planner finds invalid (for example a named
/// layout the mig-parted config lacks) are errors, as in [`load_policies`]. With nodes the
/// result is the converged state (see [`converge`](crate::converge)) unless `single_pass`.
pub fn render_text(
    policies: Vec<GpuSharingPolicy>,
    nodes: Option<Vec<NodeFacts>>,
    options: &RenderOptions,
) -> Result<Rendered, Vec<RenderError>> {
    let with_nodes = nodes.is_some();
    // Without a cluster the ClusterPolicy is unknown: VM policies are rendered as the GPU
    // Operator would serve them with its vGPU Manager on and KubeVirt's sandbox device plugin
    // (the controller checks the real ClusterPolicy and names the field when it is not so).
    let (pools, overlays, table) = karpenter_objects(options.karpenter.as_deref());
    let view = ClusterView {
        policies,
        nodes: nodes
            .unwrap_or_default()
            .into_iter()
            .map(Arc::new)
            .collect(),
        cluster_policies: None,
        // Files carry no DeviceClasses: none of someone else's is assumed to map a name (and
        // no ResourceSlice: the converged view plays the DRA driver's).
        device_classes: Some(Vec::new()),
        slices: Some(Vec::new()),
        configmaps: table.into_iter().collect(),
        karpenter: options.karpenter.as_ref().map(|_| KarpenterView {
            node_pools: pools.iter().collect(),
            overlays: overlays.iter().collect(),
        }),
        ..Default::default()
    };
    let mut input = observe::plan_input(view, &Settings::default(), Memory::default());
    // Files carry no ConfigMaps: the named layouts are the GPU Operator's default config (or
    // `--mig-parted-config`).
    input.cluster.base_mig_configs = Some(options.base_mig_configs.clone());
    let first = plan::plan(&input);
    let invalid = planner_errors(&first);
    if !invalid.is_empty() {
        return Err(invalid);
    }
    let (plan, input, passes) = if with_nodes && !options.single_pass {
        let c = crate::converge::converge(input).map_err(|e| {
            vec![RenderError::Input {
                path: PathBuf::from("--nodes"),
                message: e.to_string(),
            }]
        })?;
        (c.plan, c.input, Some(c.passes))
    } else {
        (first, input, None)
    };
    let mut text = String::new();
    if let Some(p) = passes {
        text.push_str(&format!(
            "# Converged after {p} planning passes ({} rounds of writes), NVIDIA's components \
             assumed to succeed (MIG manager confirms, GPU Feature Discovery reports the new \
             replicas).\n",
            p - 1
        ));
    }
    for d in documents_of(&plan, &input, &options.namespace, with_nodes) {
        text.push_str("---\n");
        text.push_str(&serde_saphyr::to_string(&d).expect("serializable"));
    }
    Ok(Rendered { text, passes })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DYN: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: dyn}\nspec:\n  nodeSelector: {}\n  strategy: mig\n  mig:\n    migStrategy: STRATEGY\n    layout: all-7g.80gb\n    dynamic: {layouts: [all-1g.10gb]}\n  rollout: {maxUnavailable: 2}\n";

    /// A rule this CEL build cannot evaluate (`rollout.maxUnavailable`'s `type()`) is left to
    /// the API server; the rules it can evaluate still refuse, naming the field.
    #[test]
    fn cel_rules_refuse_what_they_can_evaluate() {
        let ok = policies_from_text(&DYN.replace("STRATEGY", "mixed"), Path::new("p.yaml"));
        assert_eq!(ok.map(|p| p.len()).map_err(|e| format!("{e:?}")), Ok(1));
        let single = policies_from_text(&DYN.replace("STRATEGY", "single"), Path::new("p.yaml"));
        let errors: Vec<String> = single.unwrap_err().iter().map(|e| e.to_string()).collect();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("dynamic needs migStrategy: mixed"),
            "{errors:?}"
        );
    }

    /// Drains for demand need a namespaceSelector and a cooldown of at least 60 s.
    #[test]
    fn drains_for_demand_need_a_namespace_selector_and_a_cooldown() {
        let with = |dynamic: &str| {
            let text = DYN
                .replace("STRATEGY", "mixed")
                .replace("{layouts: [all-1g.10gb]}", dynamic);
            policies_from_text(&text, Path::new("p.yaml"))
                .map(|p| p.len())
                .map_err(|e| {
                    e.iter()
                        .map(|e| e.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                })
        };
        let selector = "namespaceSelector: {matchLabels: {team: ml}}";
        let drains = "drainBusyNodes: {maxPodPriority: 0}";
        assert_eq!(
            with(&format!("{{layouts: [all-1g.10gb], {drains}, {selector}}}")),
            Ok(1)
        );
        let e = with(&format!("{{layouts: [all-1g.10gb], {drains}}}")).unwrap_err();
        assert!(
            e.contains("drainBusyNodes needs a namespaceSelector"),
            "{e}"
        );
        let e = with(&format!(
            "{{layouts: [all-1g.10gb], {drains}, {selector}, minLayoutLifetimeSeconds: 59}}"
        ))
        .unwrap_err();
        assert!(
            e.contains("minLayoutLifetimeSeconds must be at least 60"),
            "{e}"
        );
        assert_eq!(
            with(&format!(
                "{{layouts: [all-1g.10gb], minLayoutLifetimeSeconds: 5, {selector}}}"
            )),
            Ok(1)
        );
        // Reservations evict nothing: no fence needed; but not together with drains.
        let reserve = "reserveBusyNodes: {maxWaitSeconds: 300}";
        assert_eq!(
            with(&format!("{{layouts: [all-1g.10gb], {reserve}}}")),
            Ok(1)
        );
        let e = with(&format!(
            "{{layouts: [all-1g.10gb], {drains}, {selector}, {reserve}}}"
        ))
        .unwrap_err();
        assert!(e.contains("set at most one of drainBusyNodes"), "{e}");
        let e = with(&format!(
            "{{layouts: [all-1g.10gb], {reserve}, minLayoutLifetimeSeconds: 30}}"
        ))
        .unwrap_err();
        assert!(
            e.contains("minLayoutLifetimeSeconds must be at least 60"),
            "{e}"
        );
    }
}
