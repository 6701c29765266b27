//! How the operator reads YAML (policies, nodes, mig-parted configs): serde-saphyr with YAML 1.2
//! booleans only, so `y`, `yes`, `on` or `no` stay strings (a policy named `y` is a name, as it
//! was with serde_yaml and as Kubernetes' typed fields read it).

use serde::de::DeserializeOwned;

fn options() -> serde_saphyr::Options {
    serde_saphyr::options! { strict_booleans: true }
}

/// One YAML document.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, serde_saphyr::Error> {
    serde_saphyr::from_str_with_options(text, options())
}

/// Every document of a multi-document text (empty documents are skipped).
pub fn documents<T: DeserializeOwned>(text: &str) -> Result<Vec<T>, serde_saphyr::Error> {
    serde_saphyr::from_multiple_with_options(text, options())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_1_1_booleans_stay_strings() {
        let v: serde_json::Value = from_str("{name: y, on: yes, real: true}").unwrap();
        assert_eq!(v["name"], "y");
        assert_eq!(v["on"], "yes");
        assert_eq!(v["real"], true);
        let docs: Vec<serde_json::Value> = documents("a: 1\n---\n---\nb: n\n").unwrap();
        assert_eq!(
            docs,
            [serde_json::json!({"a": 1}), serde_json::json!({"b": "n"})]
        );
    }
}
