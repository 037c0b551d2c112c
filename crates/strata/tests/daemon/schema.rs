//! A small checker of JSON values against the OpenAPI document's component schemas.

use serde_json::Value;

/// `v` has every property `schema` (a component of the OpenAPI document) requires and none
/// it does not list, recursively through references and nullable/one-of wrappers.
pub fn conforms(schemas: &Value, name: &str, v: &Value) {
    let s = &schemas[name];
    assert!(!s.is_null(), "no schema {name}");
    check(schemas, s, v, name);
}

fn check(schemas: &Value, s: &Value, v: &Value, at: &str) {
    if let Some(r) = s["$ref"].as_str() {
        let name = r.rsplit('/').next().unwrap();
        return check(schemas, &schemas[name], v, at);
    }
    if let Some(alts) = s["oneOf"].as_array() {
        if v.is_null() && alts.iter().any(|a| a["type"] == "null") {
            return;
        }
        let a = alts.iter().find(|a| a["type"] != "null").unwrap();
        return check(schemas, a, v, at);
    }
    let types: Vec<&str> = match &s["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(|t| t.as_str()).collect(),
        _ => vec![],
    };
    if v.is_null() {
        assert!(types.contains(&"null"), "{at}: null where {s} is expected");
        return;
    }
    if types.contains(&"object") {
        let o = v
            .as_object()
            .unwrap_or_else(|| panic!("{at}: not an object: {v}"));
        let props = s["properties"].as_object();
        for req in s["required"].as_array().into_iter().flatten() {
            let k = req.as_str().unwrap();
            assert!(o.contains_key(k), "{at}: missing {k}: {v}");
        }
        if let Some(props) = props {
            for (k, val) in o {
                let p = props
                    .get(k)
                    .unwrap_or_else(|| panic!("{at}: {k} is not in the schema"));
                check(schemas, p, val, &format!("{at}.{k}"));
            }
        }
    } else if types.contains(&"integer") {
        assert!(v.is_u64() || v.is_i64(), "{at}: not an integer: {v}");
    } else if types.contains(&"string") {
        assert!(v.is_string(), "{at}: not a string: {v}");
        if let Some(e) = s["enum"].as_array() {
            assert!(e.contains(v), "{at}: {v} not one of {e:?}");
        }
    } else if types.contains(&"boolean") {
        assert!(v.is_boolean(), "{at}: not a boolean: {v}");
    } else if types.contains(&"array") {
        for x in v.as_array().unwrap() {
            check(schemas, &s["items"], x, at);
        }
    }
}
