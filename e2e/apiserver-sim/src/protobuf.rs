//! kube-apiserver's protobuf encoding (`application/vnd.kubernetes.protobuf`) for Services,
//! IPAddresses, ServiceCIDRs, Namespaces, ConfigMaps and Secrets (and `Status`, for errors), both
//! ways: kubectl sends the objects its generators make (`kubectl create
//! service|namespace|configmap|secret`) in protobuf and reads the answers in it. Objects are stored as JSON; each is encoded from it
//! once, on first request, and request bodies are decoded to it, with a schema of field numbers
//! taken from upstream's `generated.proto` (checked against upstream's round-trip fixtures in the
//! tests).
//!
//! The wire format is upstream's: the 4-byte magic `k8s\0`, then a `runtime.Unknown` envelope
//! (1: typeMeta {1: apiVersion, 2: kind}, 2: raw object bytes, 3: contentEncoding, 4:
//! contentType). Fields are written in field-number order, map entries sorted by key, times as
//! `{1: seconds, 2: nanos}`. Absent JSON fields are not written (Go writes zero values of
//! non-pointer fields; both decode to the same object).

use prost::encoding::{WireType, encode_key, encode_varint};
use serde_json::Value;

/// The media type clients send in `Accept` to ask for protobuf.
pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";
const MAGIC: &[u8; 4] = b"k8s\0";

/// How a field's JSON value is written.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Int,
    Bool,
    Msg(&'static [Field]),
    /// `metav1.Time`: an RFC 3339 string, written as `{1: seconds, 2: nanos}`.
    Time,
    /// `intstr.IntOrString`: `{1: type, 2: intVal, 3: strVal}`.
    IntOrString,
    /// `metav1.FieldsV1`: any JSON, written as its compact text in field 1.
    FieldsV1,
    /// `map<string, string>`.
    StrMap,
    /// `map<string, bytes>`: base64 strings in JSON.
    BytesMap,
}

#[derive(Clone, Copy)]
struct Field {
    json: &'static str,
    number: u32,
    kind: Kind,
    repeated: bool,
}

const fn f(json: &'static str, number: u32, kind: Kind) -> Field {
    Field {
        json,
        number,
        kind,
        repeated: false,
    }
}

const fn r(json: &'static str, number: u32, kind: Kind) -> Field {
    Field {
        json,
        number,
        kind,
        repeated: true,
    }
}

use Kind::{Bool, BytesMap, FieldsV1, Int, IntOrString, Msg, Str, StrMap, Time};

const OWNER_REFERENCE: &[Field] = &[
    f("kind", 1, Str),
    f("name", 3, Str),
    f("uid", 4, Str),
    f("apiVersion", 5, Str),
    f("controller", 6, Bool),
    f("blockOwnerDeletion", 7, Bool),
];

const MANAGED_FIELDS_ENTRY: &[Field] = &[
    f("manager", 1, Str),
    f("operation", 2, Str),
    f("apiVersion", 3, Str),
    f("time", 4, Time),
    f("fieldsType", 6, Str),
    f("fieldsV1", 7, FieldsV1),
    f("subresource", 8, Str),
];

const OBJECT_META: &[Field] = &[
    f("name", 1, Str),
    f("generateName", 2, Str),
    f("namespace", 3, Str),
    f("selfLink", 4, Str),
    f("uid", 5, Str),
    f("resourceVersion", 6, Str),
    f("generation", 7, Int),
    f("creationTimestamp", 8, Time),
    f("deletionTimestamp", 9, Time),
    f("deletionGracePeriodSeconds", 10, Int),
    f("labels", 11, StrMap),
    f("annotations", 12, StrMap),
    r("ownerReferences", 13, Msg(OWNER_REFERENCE)),
    r("finalizers", 14, Str),
    r("managedFields", 17, Msg(MANAGED_FIELDS_ENTRY)),
];

const LIST_META: &[Field] = &[
    f("selfLink", 1, Str),
    f("resourceVersion", 2, Str),
    f("continue", 3, Str),
    f("remainingItemCount", 4, Int),
];

const CONDITION: &[Field] = &[
    f("type", 1, Str),
    f("status", 2, Str),
    f("observedGeneration", 3, Int),
    f("lastTransitionTime", 4, Time),
    f("reason", 5, Str),
    f("message", 6, Str),
];

const SERVICE_PORT: &[Field] = &[
    f("name", 1, Str),
    f("protocol", 2, Str),
    f("port", 3, Int),
    f("targetPort", 4, IntOrString),
    f("nodePort", 5, Int),
    f("appProtocol", 6, Str),
];

const CLIENT_IP_CONFIG: &[Field] = &[f("timeoutSeconds", 1, Int)];
const SESSION_AFFINITY_CONFIG: &[Field] = &[f("clientIP", 1, Msg(CLIENT_IP_CONFIG))];

const SERVICE_SPEC: &[Field] = &[
    r("ports", 1, Msg(SERVICE_PORT)),
    f("selector", 2, StrMap),
    f("clusterIP", 3, Str),
    f("type", 4, Str),
    r("externalIPs", 5, Str),
    f("sessionAffinity", 7, Str),
    f("loadBalancerIP", 8, Str),
    r("loadBalancerSourceRanges", 9, Str),
    f("externalName", 10, Str),
    f("externalTrafficPolicy", 11, Str),
    f("healthCheckNodePort", 12, Int),
    f("publishNotReadyAddresses", 13, Bool),
    f("sessionAffinityConfig", 14, Msg(SESSION_AFFINITY_CONFIG)),
    f("ipFamilyPolicy", 17, Str),
    r("clusterIPs", 18, Str),
    r("ipFamilies", 19, Str),
    f("allocateLoadBalancerNodePorts", 20, Bool),
    f("loadBalancerClass", 21, Str),
    f("internalTrafficPolicy", 22, Str),
    f("trafficDistribution", 23, Str),
];

const PORT_STATUS: &[Field] = &[f("port", 1, Int), f("protocol", 2, Str), f("error", 3, Str)];

const LOAD_BALANCER_INGRESS: &[Field] = &[
    f("ip", 1, Str),
    f("hostname", 2, Str),
    f("ipMode", 3, Str),
    r("ports", 4, Msg(PORT_STATUS)),
];

const LOAD_BALANCER_STATUS: &[Field] = &[r("ingress", 1, Msg(LOAD_BALANCER_INGRESS))];

const SERVICE_STATUS: &[Field] = &[
    f("loadBalancer", 1, Msg(LOAD_BALANCER_STATUS)),
    r("conditions", 2, Msg(CONDITION)),
];

const SERVICE: &[Field] = &[
    f("metadata", 1, Msg(OBJECT_META)),
    f("spec", 2, Msg(SERVICE_SPEC)),
    f("status", 3, Msg(SERVICE_STATUS)),
];

const PARENT_REFERENCE: &[Field] = &[
    f("group", 1, Str),
    f("resource", 2, Str),
    f("namespace", 3, Str),
    f("name", 4, Str),
];

const IPADDRESS_SPEC: &[Field] = &[f("parentRef", 1, Msg(PARENT_REFERENCE))];

const IPADDRESS: &[Field] = &[
    f("metadata", 1, Msg(OBJECT_META)),
    f("spec", 2, Msg(IPADDRESS_SPEC)),
];

const SERVICE_CIDR_SPEC: &[Field] = &[r("cidrs", 1, Str)];
const SERVICE_CIDR_STATUS: &[Field] = &[r("conditions", 1, Msg(CONDITION))];

const SERVICE_CIDR: &[Field] = &[
    f("metadata", 1, Msg(OBJECT_META)),
    f("spec", 2, Msg(SERVICE_CIDR_SPEC)),
    f("status", 3, Msg(SERVICE_CIDR_STATUS)),
];

const NAMESPACE_CONDITION: &[Field] = &[
    f("type", 1, Str),
    f("status", 2, Str),
    f("lastTransitionTime", 4, Time),
    f("reason", 5, Str),
    f("message", 6, Str),
];

const NAMESPACE: &[Field] = &[
    f("metadata", 1, Msg(OBJECT_META)),
    f("spec", 2, Msg(&[r("finalizers", 1, Str)])),
    f(
        "status",
        3,
        Msg(&[
            f("phase", 1, Str),
            r("conditions", 2, Msg(NAMESPACE_CONDITION)),
        ]),
    ),
];

const CONFIG_MAP: &[Field] = &[
    f("metadata", 1, Msg(OBJECT_META)),
    f("data", 2, StrMap),
    f("binaryData", 3, BytesMap),
    f("immutable", 4, Bool),
];

// k8s.io/api/core/v1/generated.proto, message Secret.
const SECRET: &[Field] = &[
    f("metadata", 1, Msg(OBJECT_META)),
    f("data", 2, BytesMap),
    f("type", 3, Str),
    f("stringData", 4, StrMap),
    f("immutable", 5, Bool),
];

const STATUS_CAUSE: &[Field] = &[
    f("reason", 1, Str),
    f("message", 2, Str),
    f("field", 3, Str),
];

const STATUS_DETAILS: &[Field] = &[
    f("name", 1, Str),
    f("group", 2, Str),
    f("kind", 3, Str),
    r("causes", 4, Msg(STATUS_CAUSE)),
    f("retryAfterSeconds", 5, Int),
    f("uid", 6, Str),
];

const STATUS: &[Field] = &[
    f("metadata", 1, Msg(LIST_META)),
    f("status", 2, Str),
    f("message", 3, Str),
    f("reason", 4, Str),
    f("details", 5, Msg(STATUS_DETAILS)),
    f("code", 6, Int),
];

/// The schema of a kind served as protobuf.
fn schema(kind: &str) -> Option<&'static [Field]> {
    Some(match kind {
        "Service" => SERVICE,
        "IPAddress" => IPADDRESS,
        "ServiceCIDR" => SERVICE_CIDR,
        "Namespace" => NAMESPACE,
        "ConfigMap" => CONFIG_MAP,
        "Secret" => SECRET,
        "Status" => STATUS,
        _ => return None,
    })
}

/// Whether objects of `kind` can be served as protobuf.
pub fn supports(kind: &str) -> bool {
    schema(kind).is_some()
}

/// Why a stored object could not be encoded (a value of the wrong JSON type).
#[derive(Debug, thiserror::Error)]
#[error("cannot encode field {field} as protobuf: {problem}")]
pub struct EncodeError {
    field: String,
    problem: String,
}

fn error(field: &str, problem: impl Into<String>) -> EncodeError {
    EncodeError {
        field: field.to_owned(),
        problem: problem.into(),
    }
}

/// The object's own protobuf bytes (no envelope): what a list carries as one item.
pub fn encode_object(kind: &str, object: &Value) -> Result<Vec<u8>, EncodeError> {
    let fields = schema(kind).ok_or_else(|| error(kind, "kind has no protobuf schema"))?;
    let mut out = Vec::new();
    encode_message(fields, object, kind, &mut out)?;
    Ok(out)
}

/// `object` with the envelope, as a GET answers it.
pub fn encode_single(
    kind: &str,
    api_version: &str,
    object: &Value,
) -> Result<Vec<u8>, EncodeError> {
    Ok(envelope(api_version, kind, &encode_object(kind, object)?))
}

/// The list body for `items` (each already encoded by [`encode_object`]): `list_meta` is the
/// JSON list metadata (`resourceVersion`, `continue`, `remainingItemCount`). Written in one
/// buffer sized up front: a page is hundreds of kilobytes.
pub fn encode_list(
    api_version: &str,
    kind: &str,
    list_meta: &Value,
    items: &[impl AsRef<[u8]>],
) -> Result<Vec<u8>, EncodeError> {
    let mut meta = Vec::new();
    encode_message(LIST_META, list_meta, "metadata", &mut meta)?;
    let raw_len = delimited_len(meta.len())
        + items
            .iter()
            .map(|item| delimited_len(item.as_ref().len()))
            .sum::<usize>();
    let type_meta = type_meta(api_version, &format!("{kind}List"));
    let mut out = Vec::with_capacity(
        MAGIC.len() + delimited_len(type_meta.len()) + delimited_len(raw_len) + 4,
    );
    out.extend_from_slice(MAGIC);
    len_delimited(1, &type_meta, &mut out);
    encode_key(2, WireType::LengthDelimited, &mut out);
    encode_varint(raw_len as u64, &mut out);
    len_delimited(1, &meta, &mut out);
    for item in items {
        len_delimited(2, item.as_ref(), &mut out);
    }
    // contentEncoding and contentType, empty, as upstream writes them.
    len_delimited(3, b"", &mut out);
    len_delimited(4, b"", &mut out);
    Ok(out)
}

/// Bytes a length-delimited field with a one-byte key and `len` bytes of payload takes.
fn delimited_len(len: usize) -> usize {
    1 + varint_len(len as u64) + len
}

fn type_meta(api_version: &str, kind: &str) -> Vec<u8> {
    let mut type_meta = Vec::new();
    len_delimited(1, api_version.as_bytes(), &mut type_meta);
    len_delimited(2, kind.as_bytes(), &mut type_meta);
    type_meta
}

fn envelope(api_version: &str, kind: &str, raw: &[u8]) -> Vec<u8> {
    let type_meta = type_meta(api_version, kind);
    let mut out = Vec::with_capacity(raw.len() + type_meta.len() + 32);
    out.extend_from_slice(MAGIC);
    len_delimited(1, &type_meta, &mut out);
    len_delimited(2, raw, &mut out);
    len_delimited(3, b"", &mut out);
    len_delimited(4, b"", &mut out);
    out
}

fn varint_len(value: u64) -> usize {
    prost::encoding::encoded_len_varint(value)
}

fn len_delimited(number: u32, bytes: &[u8], out: &mut Vec<u8>) {
    encode_key(number, WireType::LengthDelimited, out);
    encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

fn encode_message(
    fields: &[Field],
    value: &Value,
    path: &str,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let object = value
        .as_object()
        .ok_or_else(|| error(path, "expected an object"))?;
    for field in fields {
        let Some(value) = object.get(field.json).filter(|v| !v.is_null()) else {
            continue;
        };
        let path = format!("{path}.{}", field.json);
        if field.repeated {
            let items = value
                .as_array()
                .ok_or_else(|| error(&path, "expected a list"))?;
            for item in items {
                encode_field(field, item, &path, out)?;
            }
        } else {
            encode_field(field, value, &path, out)?;
        }
    }
    Ok(())
}

fn encode_field(
    field: &Field,
    value: &Value,
    path: &str,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let number = field.number;
    match field.kind {
        Str => {
            let text = value
                .as_str()
                .ok_or_else(|| error(path, "expected a string"))?;
            len_delimited(number, text.as_bytes(), out);
        }
        Int => {
            let int = value
                .as_i64()
                .ok_or_else(|| error(path, "expected an integer"))?;
            encode_key(number, WireType::Varint, out);
            // Negative int32/int64 values are written as 64-bit two's complement, as Go does.
            encode_varint(int as u64, out);
        }
        Bool => {
            let flag = value
                .as_bool()
                .ok_or_else(|| error(path, "expected a boolean"))?;
            encode_key(number, WireType::Varint, out);
            encode_varint(u64::from(flag), out);
        }
        Msg(fields) => {
            let mut inner = Vec::new();
            encode_message(fields, value, path, &mut inner)?;
            len_delimited(number, &inner, out);
        }
        Time => {
            let text = value
                .as_str()
                .ok_or_else(|| error(path, "expected an RFC 3339 time"))?;
            let time: jiff::Timestamp = text
                .parse()
                .map_err(|e| error(path, format!("not an RFC 3339 time: {e}")))?;
            let mut inner = Vec::new();
            encode_key(1, WireType::Varint, &mut inner);
            encode_varint(time.as_second() as u64, &mut inner);
            // Upstream keeps whole seconds only (metav1.Time's JSON form has no fraction).
            encode_key(2, WireType::Varint, &mut inner);
            encode_varint(0, &mut inner);
            len_delimited(number, &inner, out);
        }
        IntOrString => {
            let mut inner = Vec::new();
            let (kind, int, text) = match value {
                Value::Number(n) => (
                    0,
                    n.as_i64()
                        .ok_or_else(|| error(path, "expected an integer or a string"))?,
                    "",
                ),
                Value::String(s) => (1, 0, s.as_str()),
                _ => return Err(error(path, "expected an integer or a string")),
            };
            encode_key(1, WireType::Varint, &mut inner);
            encode_varint(kind, &mut inner);
            encode_key(2, WireType::Varint, &mut inner);
            encode_varint(int as u64, &mut inner);
            len_delimited(3, text.as_bytes(), &mut inner);
            len_delimited(number, &inner, out);
        }
        FieldsV1 => {
            let raw = serde_json::to_vec(value).map_err(|e| error(path, e.to_string()))?;
            let mut inner = Vec::new();
            len_delimited(1, &raw, &mut inner);
            len_delimited(number, &inner, out);
        }
        StrMap | BytesMap => {
            let map = value
                .as_object()
                .ok_or_else(|| error(path, "expected a map of strings"))?;
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            for (key, value) in entries {
                let text = value
                    .as_str()
                    .ok_or_else(|| error(&format!("{path}.{key}"), "expected a string"))?;
                let bytes = if matches!(field.kind, BytesMap) {
                    use base64::Engine;
                    base64::engine::general_purpose::STANDARD
                        .decode(text)
                        .map_err(|e| error(&format!("{path}.{key}"), format!("not base64: {e}")))?
                } else {
                    text.as_bytes().to_vec()
                };
                let mut entry = Vec::new();
                len_delimited(1, key.as_bytes(), &mut entry);
                len_delimited(2, &bytes, &mut entry);
                len_delimited(number, &entry, out);
            }
        }
    }
    Ok(())
}

/// Why a request body in protobuf could not be read.
#[derive(Debug, thiserror::Error)]
#[error("the protobuf body cannot be decoded: {0}")]
pub struct DecodeError(String);

/// A request body in protobuf (`k8s\0` and the `runtime.Unknown` envelope) as the JSON object it
/// stands for. Fields Go writes with their zero value (empty strings, 0, false, the zero time)
/// are left out, as `omitempty` leaves them out of Go's JSON: both are the same object.
pub fn decode_single(body: &[u8]) -> Result<Value, DecodeError> {
    let invalid = |what: &str| DecodeError(what.to_owned());
    let envelope = body
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| invalid("it does not start with k8s\\0"))?;
    let (mut api_version, mut kind, mut raw) = (String::new(), String::new(), None);
    for field in fields(envelope)? {
        match (field.number, field.value) {
            (1, Wire::Bytes(type_meta)) => {
                for field in fields(type_meta)? {
                    match (field.number, field.value) {
                        (1, Wire::Bytes(text)) => api_version = utf8(text)?,
                        (2, Wire::Bytes(text)) => kind = utf8(text)?,
                        _ => {}
                    }
                }
            }
            (2, Wire::Bytes(bytes)) => raw = Some(bytes),
            _ => {}
        }
    }
    let schema =
        schema(&kind).ok_or_else(|| DecodeError(format!("kind {kind:?} has no schema")))?;
    let mut object = decode_message(schema, raw.unwrap_or_default())?;
    if let Value::Object(map) = &mut object {
        map.insert("apiVersion".to_owned(), Value::String(api_version));
        map.insert("kind".to_owned(), Value::String(kind));
    }
    Ok(object)
}

/// One field as read off the wire.
struct WireField<'a> {
    number: u32,
    value: Wire<'a>,
}

enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    /// Fixed-width values: no schema here has them; skipped.
    Fixed,
}

fn fields(mut bytes: &[u8]) -> Result<Vec<WireField<'_>>, DecodeError> {
    let truncated = || DecodeError("a field is cut short".to_owned());
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let key = prost::encoding::decode_varint(&mut bytes).map_err(|_| truncated())?;
        let number = u32::try_from(key >> 3).map_err(|_| truncated())?;
        let value = match key & 7 {
            0 => Wire::Varint(prost::encoding::decode_varint(&mut bytes).map_err(|_| truncated())?),
            2 => {
                let len = prost::encoding::decode_varint(&mut bytes).map_err(|_| truncated())?;
                let len = usize::try_from(len).map_err(|_| truncated())?;
                let (value, rest) = bytes.split_at_checked(len).ok_or_else(truncated)?;
                bytes = rest;
                Wire::Bytes(value)
            }
            1 => {
                bytes = bytes.get(8..).ok_or_else(truncated)?;
                Wire::Fixed
            }
            5 => {
                bytes = bytes.get(4..).ok_or_else(truncated)?;
                Wire::Fixed
            }
            other => return Err(DecodeError(format!("wire type {other} is not supported"))),
        };
        out.push(WireField { number, value });
    }
    Ok(out)
}

fn utf8(bytes: &[u8]) -> Result<String, DecodeError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| DecodeError("a string is not UTF-8".to_owned()))
}

/// Go's zero `time.Time` (0001-01-01T00:00:00Z), which it writes for an unset non-pointer time.
const GO_ZERO_TIME_SECONDS: i64 = -62_135_596_800;

fn decode_message(schema: &[Field], bytes: &[u8]) -> Result<Value, DecodeError> {
    let mut object = serde_json::Map::new();
    for wire in fields(bytes)? {
        let Some(field) = schema.iter().find(|field| field.number == wire.number) else {
            continue;
        };
        let value = match decode_value(field.kind, wire.value)? {
            Some(value) => value,
            None => continue,
        };
        if matches!(field.kind, StrMap | BytesMap) {
            // Each map entry is a field of its own.
            if let (Value::Object(entry), Value::Object(map)) = (
                value,
                object
                    .entry(field.json)
                    .or_insert_with(|| Value::Object(serde_json::Map::new())),
            ) {
                map.extend(entry);
            }
        } else if field.repeated {
            if let Value::Array(items) = object
                .entry(field.json)
                .or_insert_with(|| Value::Array(Vec::new()))
            {
                items.push(value);
            }
        } else {
            object.insert(field.json.to_owned(), value);
        }
    }
    Ok(Value::Object(object))
}

/// One value of `kind`; `None` for a zero value Go's JSON would leave out.
fn decode_value(kind: Kind, wire: Wire<'_>) -> Result<Option<Value>, DecodeError> {
    let mismatch = || DecodeError("a field has the wrong wire type for its schema".to_owned());
    Ok(match (kind, wire) {
        (Str, Wire::Bytes(bytes)) => Some(Value::String(utf8(bytes)?)).filter(|v| v != ""),
        // int32/int64 negatives arrive as 64-bit two's complement.
        (Int, Wire::Varint(int)) => (int != 0).then(|| Value::from(int as i64)),
        (Bool, Wire::Varint(flag)) => (flag != 0).then_some(Value::Bool(true)),
        (Msg(schema), Wire::Bytes(bytes)) => Some(decode_message(schema, bytes)?),
        (Time, Wire::Bytes(bytes)) => {
            let mut seconds = 0i64;
            for field in fields(bytes)? {
                if let (1, Wire::Varint(value)) = (field.number, field.value) {
                    seconds = value as i64;
                }
            }
            if seconds == GO_ZERO_TIME_SECONDS {
                None
            } else {
                let time = jiff::Timestamp::from_second(seconds)
                    .map_err(|e| DecodeError(format!("a time is out of range: {e}")))?;
                Some(Value::String(
                    time.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
                ))
            }
        }
        (IntOrString, Wire::Bytes(bytes)) => {
            let (mut kind, mut int, mut text) = (0, 0i64, String::new());
            for field in fields(bytes)? {
                match (field.number, field.value) {
                    (1, Wire::Varint(value)) => kind = value,
                    (2, Wire::Varint(value)) => int = value as i64,
                    (3, Wire::Bytes(value)) => text = utf8(value)?,
                    _ => {}
                }
            }
            Some(if kind == 1 {
                Value::String(text)
            } else {
                Value::from(int)
            })
        }
        (FieldsV1, Wire::Bytes(bytes)) => {
            let mut raw: &[u8] = b"{}";
            for field in fields(bytes)? {
                if let (1, Wire::Bytes(value)) = (field.number, field.value) {
                    raw = value;
                }
            }
            Some(
                serde_json::from_slice(raw)
                    .map_err(|e| DecodeError(format!("fieldsV1 is not JSON: {e}")))?,
            )
        }
        (StrMap | BytesMap, Wire::Bytes(bytes)) => {
            let (mut key, mut value) = (String::new(), Vec::new());
            for field in fields(bytes)? {
                match (field.number, field.value) {
                    (1, Wire::Bytes(text)) => key = utf8(text)?,
                    (2, Wire::Bytes(bytes)) => value = bytes.to_vec(),
                    _ => {}
                }
            }
            let value = if matches!(kind, BytesMap) {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD.encode(value)
            } else {
                String::from_utf8(value)
                    .map_err(|_| DecodeError("a map value is not UTF-8".to_owned()))?
            };
            let mut entry = serde_json::Map::new();
            entry.insert(key, Value::String(value));
            Some(Value::Object(entry))
        }
        _ => return Err(mismatch()),
    })
}

/// Whether an `Accept` header prefers protobuf for a kind that has it: the first media type
/// the server can produce wins, as kube-apiserver negotiates (clients send
/// `application/vnd.kubernetes.protobuf, application/json`).
pub fn preferred(accept: &str, kind: &str) -> bool {
    for media in accept.split(',') {
        let media = media.split(';').next().unwrap_or("").trim();
        match media {
            MEDIA_TYPE if supports(kind) => return true,
            "application/json" | "application/*" | "*/*" => return false,
            _ => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/k8s-api");

    /// Upstream's round-trip fixtures: our encoding of the JSON is byte for byte upstream's
    /// protobuf. Every field of these types is set in them, so a wrong field number, order,
    /// map layout or time encoding shows.
    #[test]
    fn encodes_upstream_fixtures_byte_for_byte() {
        for (file, kind, api_version) in [
            ("core.v1.Service", "Service", "v1"),
            (
                "networking.k8s.io.v1.IPAddress",
                "IPAddress",
                "networking.k8s.io/v1",
            ),
            (
                "networking.k8s.io.v1.ServiceCIDR",
                "ServiceCIDR",
                "networking.k8s.io/v1",
            ),
            ("core.v1.Namespace", "Namespace", "v1"),
        ] {
            let (object, pb) = fixture(file);
            let ours = encode_single(kind, api_version, &object).unwrap();
            assert_eq!(ours, pb, "{file}: our protobuf differs from upstream's");
        }
    }

    fn fixture(file: &str) -> (Value, Vec<u8>) {
        let json = std::fs::read(format!("{FIXTURES}/{file}.json"));
        let pb = std::fs::read(format!("{FIXTURES}/{file}.pb"));
        let (Ok(json), Ok(pb)) = (json, pb) else {
            panic!("fixture {file} missing under {FIXTURES}");
        };
        (serde_json::from_slice(&json).unwrap(), pb)
    }

    /// Upstream's protobuf decodes to exactly upstream's JSON (every field of each type set).
    #[test]
    fn decodes_upstream_fixtures_to_their_json() {
        for file in [
            "core.v1.Service",
            "networking.k8s.io.v1.IPAddress",
            "networking.k8s.io.v1.ServiceCIDR",
            "core.v1.Namespace",
        ] {
            let (object, pb) = fixture(file);
            assert_eq!(decode_single(&pb).unwrap(), object, "{file}");
        }
    }

    /// What Go writes for unset non-pointer fields (empty strings, zeros, false, the zero time)
    /// is left out, as Go's JSON leaves it out; a ConfigMap's binary data comes back as base64.
    #[test]
    fn zero_values_are_left_out_and_bytes_are_base64() {
        let object = serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            // Go's zero time: what it writes for an unset creationTimestamp.
            "metadata": {"name": "c", "namespace": "", "generation": 0,
                         "creationTimestamp": "0001-01-01T00:00:00Z"},
            "data": {"a": "b"},
            "binaryData": {"bin": "AAEC"},
            "immutable": false,
        });
        let mut pb = encode_single("ConfigMap", "v1", &object).unwrap();
        let decoded = decode_single(&pb).unwrap();
        assert_eq!(
            decoded,
            serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "c"},
                "data": {"a": "b"},
                "binaryData": {"bin": "AAEC"},
            })
        );
        pb.truncate(3);
        assert!(
            decode_single(&pb).is_err(),
            "a cut body is an error, not a panic"
        );
        assert!(decode_single(b"{}").is_err());
    }

    /// The list writer (sized up front, no intermediate copy) lays out exactly what wrapping a
    /// `{1: metadata, 2: items}` message in the envelope gives.
    #[test]
    fn list_is_the_envelope_of_metadata_and_items() {
        let items = [
            vec![0x0a, 0x00],
            vec![0x0a, 0x03, 0x0a, 0x01, b'x'],
            vec![7u8; 300],
        ];
        let meta = serde_json::json!({"resourceVersion": "42", "continue": "abc"});
        let mut raw = Vec::new();
        let mut encoded_meta = Vec::new();
        encode_message(LIST_META, &meta, "metadata", &mut encoded_meta).unwrap();
        len_delimited(1, &encoded_meta, &mut raw);
        for item in &items {
            len_delimited(2, item, &mut raw);
        }
        let list = encode_list("v1", "Service", &meta, &items).unwrap();
        assert_eq!(list, envelope("v1", "ServiceList", &raw));
        assert_eq!(list.capacity(), list.len(), "sized up front");
    }

    #[test]
    fn accept_negotiation_follows_the_clients_order() {
        let both = "application/vnd.kubernetes.protobuf, application/json";
        assert!(preferred(both, "Service"));
        assert!(preferred(both, "Namespace"));
        assert!(!preferred(both, "Lease"), "no schema: JSON");
        assert!(!preferred(
            "application/json, application/vnd.kubernetes.protobuf",
            "Service"
        ));
        assert!(!preferred("", "Service"));
        assert!(preferred(
            "application/vnd.kubernetes.protobuf;q=1",
            "IPAddress"
        ));
    }

    #[test]
    fn wrong_json_types_name_the_field() {
        let bad = serde_json::json!({"metadata": {"name": 5}});
        let err = encode_object("Service", &bad).unwrap_err().to_string();
        assert!(err.contains("Service.metadata.name"), "{err}");
    }
}
