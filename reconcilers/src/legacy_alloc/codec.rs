//! The `RangeAllocation` kube-apiserver stores at `<prefix>/ranges/servicenodeports` (and
//! `serviceips`, `secondaryserviceips`), encoded exactly as kube-apiserver encodes it.
//!
//! In etcd the value is the protobuf storage encoding (`k8s\0` and a `runtime.Unknown` envelope
//! around the object's bytes), or JSON where the apiserver stores JSON. A value read is written
//! back in the encoding it came in, with its metadata bytes untouched; a new value is protobuf,
//! kube-apiserver's default. `data` is the allocation bitmap as Go's `big.Int.Bytes()`: big-endian
//! and minimal, offset `i` is bit `i % 8` of byte `len - 1 - i / 8`.

use base64::Engine;
use fixedbitset::FixedBitSet;
use prost::Message;

/// The protobuf storage encoding starts with these four bytes.
pub const PROTOBUF_MAGIC: &[u8] = b"k8s\0";
/// A value encrypted at rest by kube-apiserver starts with this.
pub const ENCRYPTED_PREFIX: &[u8] = b"k8s:enc:";

/// Why a stored value cannot be used. The loops report it and write nothing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error(
        "the value is encrypted at rest (it starts with \"k8s:enc:\"); the repair cannot read it: \
         exclude rangeallocations from the apiserver's EncryptionConfiguration or run without \
         --etcd-servers"
    )]
    Encrypted,
    #[error("the value is not a RangeAllocation: {0}")]
    Invalid(String),
}

/// A decoded `RangeAllocation`: its range, its bitmap bytes and, kept as they were, its metadata,
/// whose form is the encoding the value is written back in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeAllocation {
    /// `"30000-32767"`, or the CIDR.
    pub range: String,
    /// The bitmap, big-endian and minimal.
    pub data: Vec<u8>,
    metadata: Metadata,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Metadata {
    /// The `ObjectMeta` message's bytes.
    Protobuf(Vec<u8>),
    Json(serde_json::Value),
}

impl RangeAllocation {
    /// A new value for a key that does not exist yet, as kube-apiserver creates it (empty
    /// metadata, protobuf).
    pub fn new(range: String, data: Vec<u8>) -> Self {
        Self {
            range,
            data,
            metadata: Metadata::Protobuf(Vec::new()),
        }
    }

    /// The same value with another bitmap.
    pub fn with_data(&self, data: Vec<u8>) -> Self {
        Self {
            data,
            ..self.clone()
        }
    }

    /// The same value (metadata and encoding kept) under `range`, with the bitmap `data`.
    pub fn with_range_and_data(&self, range: String, data: Vec<u8>) -> Self {
        Self {
            range,
            data,
            ..self.clone()
        }
    }

    pub fn decode(value: &[u8]) -> Result<Self, DecodeError> {
        if value.starts_with(ENCRYPTED_PREFIX) {
            return Err(DecodeError::Encrypted);
        }
        if let Some(envelope) = value.strip_prefix(PROTOBUF_MAGIC) {
            return Self::decode_protobuf(envelope);
        }
        if value.first() == Some(&b'{') {
            return Self::decode_json(value);
        }
        Err(DecodeError::Invalid(
            "neither protobuf (k8s\\0) nor JSON".to_owned(),
        ))
    }

    fn decode_protobuf(envelope: &[u8]) -> Result<Self, DecodeError> {
        let invalid = |err: prost::DecodeError| DecodeError::Invalid(err.to_string());
        let unknown = Unknown::decode(envelope).map_err(invalid)?;
        let type_meta = unknown.type_meta.unwrap_or_default();
        check_type(
            type_meta.api_version.as_deref().unwrap_or_default(),
            type_meta.kind.as_deref().unwrap_or_default(),
        )?;
        let object = RangeAllocationMessage::decode(unknown.raw.unwrap_or_default().as_slice())
            .map_err(invalid)?;
        Ok(Self {
            range: object.range.unwrap_or_default(),
            data: object.data.unwrap_or_default(),
            metadata: Metadata::Protobuf(object.metadata.unwrap_or_default()),
        })
    }

    fn decode_json(value: &[u8]) -> Result<Self, DecodeError> {
        let object: JsonRangeAllocation = serde_json::from_slice(value)
            .map_err(|err| DecodeError::Invalid(format!("JSON: {err}")))?;
        check_type(&object.api_version, &object.kind)?;
        let data = base64::engine::general_purpose::STANDARD
            .decode(object.data.as_bytes())
            .map_err(|err| DecodeError::Invalid(format!("data is not base64: {err}")))?;
        Ok(Self {
            range: object.range,
            data,
            metadata: Metadata::Json(object.metadata),
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        match &self.metadata {
            Metadata::Protobuf(metadata) => {
                let object = RangeAllocationMessage {
                    metadata: Some(metadata.clone()),
                    range: Some(self.range.clone()),
                    data: Some(self.data.clone()),
                };
                let unknown = Unknown {
                    type_meta: Some(TypeMeta {
                        api_version: Some("v1".to_owned()),
                        kind: Some("RangeAllocation".to_owned()),
                    }),
                    raw: Some(object.encode_to_vec()),
                    content_encoding: Some(String::new()),
                    content_type: Some(String::new()),
                };
                let mut out = PROTOBUF_MAGIC.to_vec();
                out.extend_from_slice(&unknown.encode_to_vec());
                out
            }
            Metadata::Json(metadata) => {
                let object = JsonRangeAllocation {
                    kind: "RangeAllocation".to_owned(),
                    api_version: "v1".to_owned(),
                    metadata: metadata.clone(),
                    range: self.range.clone(),
                    data: base64::engine::general_purpose::STANDARD.encode(&self.data),
                };
                let mut out = serde_json::to_vec(&object).unwrap_or_default();
                // kube-apiserver's JSON serializer ends every object with a newline.
                out.push(b'\n');
                out
            }
        }
    }
}

fn check_type(api_version: &str, kind: &str) -> Result<(), DecodeError> {
    if api_version == "v1" && kind == "RangeAllocation" {
        Ok(())
    } else {
        // etcd's text, quoted in a finding kept while it lasts: cut.
        let cut = |text: &str| crate::sanitize::Sanitized::within(text, 64);
        Err(DecodeError::Invalid(format!(
            "apiVersion \"{}\" kind \"{}\", expected v1 RangeAllocation",
            cut(api_version),
            cut(kind)
        )))
    }
}

/// The bitmap of `size` offsets in `data` (bits past `size` are ignored: upstream's allocator
/// can never hand them out).
pub fn bitmap_from_bytes(data: &[u8], size: usize) -> FixedBitSet {
    let mut bits = FixedBitSet::with_capacity(size);
    // Only the last bytes hold offsets below `size`: a value of megabytes costs no more.
    for (from_end, byte) in data.iter().rev().take(size.div_ceil(8)).enumerate() {
        for bit in 0..8 {
            if byte & (1 << bit) != 0 {
                let offset = from_end * 8 + bit;
                if offset < size {
                    bits.insert(offset);
                }
            }
        }
    }
    bits
}

/// The bitmap's bytes as Go's `big.Int.Bytes()`: big-endian, no leading zero bytes.
pub fn bitmap_to_bytes(bits: &FixedBitSet) -> Vec<u8> {
    let Some(highest) = bits.maximum() else {
        return Vec::new();
    };
    let mut data = vec![0u8; highest / 8 + 1];
    let len = data.len();
    for offset in bits.ones() {
        data[len - 1 - offset / 8] |= 1 << (offset % 8);
    }
    data
}

#[derive(Clone, PartialEq, prost::Message)]
struct TypeMeta {
    #[prost(string, optional, tag = "1")]
    api_version: Option<String>,
    #[prost(string, optional, tag = "2")]
    kind: Option<String>,
}

/// `runtime.Unknown`. Optional fields, so empty strings are written as kube-apiserver writes
/// them (its generated marshallers write every string field).
#[derive(Clone, PartialEq, prost::Message)]
struct Unknown {
    #[prost(message, optional, tag = "1")]
    type_meta: Option<TypeMeta>,
    #[prost(bytes = "vec", optional, tag = "2")]
    raw: Option<Vec<u8>>,
    #[prost(string, optional, tag = "3")]
    content_encoding: Option<String>,
    #[prost(string, optional, tag = "4")]
    content_type: Option<String>,
}

/// `core/v1.RangeAllocation`, its metadata kept as bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct RangeAllocationMessage {
    #[prost(bytes = "vec", optional, tag = "1")]
    metadata: Option<Vec<u8>>,
    #[prost(string, optional, tag = "2")]
    range: Option<String>,
    #[prost(bytes = "vec", optional, tag = "3")]
    data: Option<Vec<u8>>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonRangeAllocation {
    #[serde(default)]
    kind: String,
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    metadata: serde_json::Value,
    #[serde(default)]
    range: String,
    #[serde(default)]
    data: String,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/k8s-api");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}"))
            .unwrap_or_else(|err| panic!("fixture {name} ({FIXTURES}): {err}"))
    }

    /// Upstream's fixture: protobuf and JSON decode alike, and re-encoding the protobuf gives
    /// the same bytes.
    #[test]
    fn upstream_fixture_decodes_and_reencodes_byte_identical() {
        let pb = fixture("core.v1.RangeAllocation.pb");
        let from_pb = RangeAllocation::decode(&pb).unwrap();
        assert_eq!(from_pb.range, "rangeValue");
        assert_eq!(from_pb.data, vec![3]);
        assert!(matches!(from_pb.metadata, Metadata::Protobuf(_)));
        assert_eq!(from_pb.encode(), pb);

        let json = fixture("core.v1.RangeAllocation.json");
        let from_json = RangeAllocation::decode(&json).unwrap();
        assert_eq!(
            (from_json.range.as_str(), from_json.data.as_slice()),
            ("rangeValue", &[3u8][..])
        );
        assert!(matches!(from_json.metadata, Metadata::Json(_)));
        let again = RangeAllocation::decode(&from_json.encode()).unwrap();
        assert_eq!(again, from_json);
    }

    #[test]
    fn a_new_value_is_what_kube_apiserver_creates() {
        let value = RangeAllocation::new("30000-32767".to_owned(), vec![0x01, 0x00]);
        let bytes = value.encode();
        // k8s\0, Unknown{typeMeta{v1, RangeAllocation}, raw{metadata{}, range, data}, "", ""}.
        let mut expected = b"k8s\0\x0a\x15\x0a\x02v1\x12\x0fRangeAllocation\x12\x13".to_vec();
        expected.extend_from_slice(b"\x0a\x00\x12\x0b30000-32767\x1a\x02\x01\x00\x1a\x00\x22\x00");
        assert_eq!(bytes, expected);
        assert_eq!(RangeAllocation::decode(&bytes).unwrap(), value);
    }

    #[test]
    fn bad_values_are_errors_not_panics() {
        assert_eq!(
            RangeAllocation::decode(b"k8s:enc:aescbc:v1:key1:...").unwrap_err(),
            DecodeError::Encrypted
        );
        assert!(RangeAllocation::decode(b"").is_err());
        assert!(RangeAllocation::decode(b"garbage").is_err());
        assert!(RangeAllocation::decode(b"k8s\0\xff\xff\xff").is_err());
        assert!(RangeAllocation::decode(b"{\"kind\":\"Service\",\"apiVersion\":\"v1\"}").is_err());
        assert!(
            RangeAllocation::decode(
                b"{\"kind\":\"RangeAllocation\",\"apiVersion\":\"v1\",\"data\":\"!!\"}"
            )
            .is_err()
        );
        // A type of 100 KiB is quoted cut: the error is kept while the value lasts.
        let long = format!(
            "{{\"kind\":\"RangeAllocation\",\"apiVersion\":\"{}\"}}",
            "v".repeat(100 * 1024)
        );
        let err = RangeAllocation::decode(long.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(err.len() < 400 && err.contains("more bytes cut"), "{err}");
        let pb = fixture("core.v1.RangeAllocation.pb");
        for cut in 0..pb.len() {
            // Any prefix decodes or fails; none panics.
            let _ = RangeAllocation::decode(&pb[..cut]);
        }
    }

    #[test]
    fn bitmaps_use_big_endian_minimal_bytes() {
        let mut bits = FixedBitSet::with_capacity(2768);
        assert_eq!(bitmap_to_bytes(&bits), Vec::<u8>::new());
        bits.insert(0);
        assert_eq!(bitmap_to_bytes(&bits), vec![0x01]);
        bits.insert(9);
        assert_eq!(bitmap_to_bytes(&bits), vec![0x02, 0x01]);
        bits.insert(2767);
        let bytes = bitmap_to_bytes(&bits);
        assert_eq!(bytes.len(), 346);
        assert_eq!(bytes[0], 0x80);
        assert_eq!(bitmap_from_bytes(&bytes, 2768), bits);
        // Bits past the size are dropped; missing leading bytes are zeros.
        assert_eq!(
            bitmap_from_bytes(&[0xff], 4).ones().collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        assert_eq!(bitmap_from_bytes(&[], 8).count_ones(..), 0);
    }

    #[test]
    fn bitmaps_round_trip() {
        let mut state = 0x9e37_79b9_u32;
        for size in [1usize, 7, 8, 9, 2768, 65_535] {
            let mut bits = FixedBitSet::with_capacity(size);
            for offset in 0..size {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                if state >> 29 == 0 {
                    bits.insert(offset);
                }
            }
            assert_eq!(
                bitmap_from_bytes(&bitmap_to_bytes(&bits), size),
                bits,
                "size {size}"
            );
        }
    }
}
