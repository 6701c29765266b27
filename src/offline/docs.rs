//! The CRD reference table of docs/crd-reference.md, generated from the CRD's OpenAPI schema (and
//! so from the Rust types and their doc comments). A test keeps the page in sync.

use kube::CustomResourceExt;
use serde_json::Value;

use crate::api::crd::GpuSharingPolicy;

fn constraints(s: &Value) -> String {
    let mut c = Vec::new();
    if let Some(e) = s.get("enum").and_then(|e| e.as_array()) {
        let v: Vec<String> = e
            .iter()
            .filter_map(|x| x.as_str().map(|s| format!("`{s}`")))
            .collect();
        c.push(format!("one of {}", v.join(", ")));
    }
    for (k, label) in [("minimum", ">="), ("maximum", "<=")] {
        if let Some(v) = s.get(k).and_then(|v| v.as_f64()) {
            c.push(format!("{label} {v}"));
        }
    }
    for (k, label) in [
        ("maxProperties", "entries <="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
        ("maxLength", "length <="),
    ] {
        if let Some(v) = s.get(k) {
            c.push(format!("{label} {v}"));
        }
    }
    if let Some(rules) = s.get("x-kubernetes-validations").and_then(|r| r.as_array()) {
        for r in rules {
            if let Some(m) = r.get("message").and_then(|m| m.as_str()) {
                c.push(format!("CEL: {m}"));
            }
        }
    }
    c.join("; ")
}

fn walk(path: &str, s: &Value, required: bool, rows: &mut Vec<String>) {
    let untyped = s.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    let ty = match s.get("type").and_then(|t| t.as_str()) {
        Some(t) => t,
        // Kept as written (a word or a list): the description says what is allowed.
        None if untyped => "any",
        None => "object",
    };
    let desc = s
        .get("description")
        .and_then(|d| d.as_str())
        .unwrap_or("")
        .replace('\n', " ")
        .replace('|', "\\|");
    if !path.is_empty() {
        rows.push(format!(
            "| `{path}` | {ty}{} | {desc} | {} |",
            if required { ", required" } else { "" },
            constraints(s).replace('|', "\\|")
        ));
    }
    // LabelSelector internals are Kubernetes' own: stop there.
    if path.ends_with("nodeSelector") {
        return;
    }
    let req: Vec<&str> = s
        .get("required")
        .and_then(|r| r.as_array())
        .map(|r| r.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    if let Some(props) = s.get("properties").and_then(|p| p.as_object()) {
        for (k, v) in props {
            let p = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            walk(&p, v, req.contains(&k.as_str()), rows);
        }
    }
    if let Some(items) = s.get("items") {
        walk(&format!("{path}[]"), items, false, rows);
    }
}

/// Markdown table of the spec fields.
pub fn crd_reference() -> String {
    let crd = serde_json::to_value(GpuSharingPolicy::crd()).expect("CRD serializes");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let mut rows = vec![
        "| field | type | description | validation |".to_string(),
        "|---|---|---|---|".to_string(),
    ];
    walk("spec", schema, true, &mut rows);
    rows.join("\n") + "\n"
}
