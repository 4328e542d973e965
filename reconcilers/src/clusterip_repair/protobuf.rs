//! LIST pages in kube-apiserver's protobuf encoding (`application/vnd.kubernetes.protobuf`),
//! decoded straight into the compact records.
//!
//! Why: at 100,000 Services most of a JSON LIST is fields the repair never reads (managedFields,
//! labels, ports, status), and JSON has to be scanned byte by byte to skip them. In protobuf
//! every field carries its length, so skipping one is a jump; the bodies are also smaller. The
//! same reason client-go's controllers ask for protobuf for built-in types.
//!
//! The decoder walks the wire format itself (field numbers from upstream's `generated.proto`,
//! checked against upstream's fixtures in the tests) and borrows every string from the body.
//! Services and IPAddresses, 230,000 objects per LIST at scale, are decoded straight into their
//! records; ServiceCIDRs build the same borrowed wire structs as the JSON path and share their
//! conversion. The tests hold both encodings to identical records.

use std::borrow::Cow;

use super::model::{
    ClusterIp, ClusterIps, IpAddressRecord, IpLabels, IpName, LABEL_IP_FAMILY, LABEL_MANAGED_BY,
    ListMeta, ListPage, Name, ParentRef, Protocol, ServiceCidrRecord, ServiceRecord, Token, array,
    equals, known_family, known_group, known_manager, known_resource, resource_version_number,
    wire,
};

/// The media type of protobuf bodies; requests `Accept` it before JSON.
pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";
/// What list requests send: protobuf if the server has it for the kind, JSON otherwise.
pub const ACCEPT: &str = "application/vnd.kubernetes.protobuf, application/json";
const MAGIC: &[u8; 4] = b"k8s\0";

/// A body that is not the protobuf it claims to be.
#[derive(Debug, thiserror::Error)]
#[error("invalid protobuf {what}: {problem}")]
pub struct DecodeError {
    what: &'static str,
    problem: &'static str,
}

#[cold]
#[inline(never)]
fn invalid(what: &'static str, problem: &'static str) -> DecodeError {
    DecodeError { what, problem }
}

/// One field's value as it is on the wire.
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    /// fixed32/fixed64: no field read here has them; skipped.
    Fixed,
}

impl<'a> Value<'a> {
    fn bytes(self, what: &'static str) -> Result<&'a [u8], DecodeError> {
        match self {
            Value::Bytes(bytes) => Ok(bytes),
            _ => Err(invalid(what, "expected a length-delimited field")),
        }
    }

    fn str(self, what: &'static str) -> Result<&'a str, DecodeError> {
        std::str::from_utf8(self.bytes(what)?).map_err(|_| invalid(what, "string is not UTF-8"))
    }

    fn varint(self, what: &'static str) -> Result<u64, DecodeError> {
        match self {
            Value::Varint(value) => Ok(value),
            _ => Err(invalid(what, "expected a varint field")),
        }
    }
}

/// The fields of one message, in wire order.
struct Fields<'a> {
    rest: &'a [u8],
    what: &'static str,
}

fn fields<'a>(message: &'a [u8], what: &'static str) -> Fields<'a> {
    Fields {
        rest: message,
        what,
    }
}

#[inline(always)]
fn varint(rest: &mut &[u8], what: &'static str) -> Result<u64, DecodeError> {
    // The usual cases first: one byte (tags, short lengths), two bytes (object lengths).
    match **rest {
        [low, ref tail @ ..] if low < 0x80 => {
            *rest = tail;
            Ok(u64::from(low))
        }
        [low, high, ref tail @ ..] if high < 0x80 => {
            *rest = tail;
            Ok(u64::from(low & 0x7f) | (u64::from(high) << 7))
        }
        _ => prost::encoding::decode_varint(rest).map_err(|_| invalid(what, "bad varint")),
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Value<'a>), DecodeError>;

    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        Some(self.read())
    }
}

impl<'a> Fields<'a> {
    #[inline(always)]
    fn read(&mut self) -> Result<(u64, Value<'a>), DecodeError> {
        let what = self.what;
        let key = varint(&mut self.rest, what)?;
        let number = key >> 3;
        let value = match key & 7 {
            0 => Value::Varint(varint(&mut self.rest, what)?),
            2 => {
                let len = usize::try_from(varint(&mut self.rest, what)?)
                    .map_err(|_| invalid(what, "length overflows"))?;
                if len > self.rest.len() {
                    return Err(invalid(what, "field runs past the end of its message"));
                }
                let (bytes, rest) = self.rest.split_at(len);
                self.rest = rest;
                Value::Bytes(bytes)
            }
            1 => self.skip(8)?,
            5 => self.skip(4)?,
            _ => return Err(invalid(what, "unsupported wire type (groups)")),
        };
        Ok((number, value))
    }

    fn skip(&mut self, len: usize) -> Result<Value<'a>, DecodeError> {
        if len > self.rest.len() {
            return Err(invalid(self.what, "field runs past the end of its message"));
        }
        self.rest = &self.rest[len..];
        Ok(Value::Fixed)
    }
}

/// A record type that LIST pages carry in protobuf.
pub trait ProtobufRecord: Sized {
    fn from_protobuf(message: &[u8]) -> Result<Self, DecodeError>;
}

/// The object bytes of a `k8s\0` + `runtime.Unknown` body.
fn unwrap_envelope(body: &[u8]) -> Result<&[u8], DecodeError> {
    let unknown = body
        .strip_prefix(MAGIC)
        .ok_or_else(|| invalid("body", "missing the k8s\\0 prefix"))?;
    let mut raw = None;
    for field in fields(unknown, "runtime.Unknown") {
        let (number, value) = field?;
        if number == 2 {
            raw = Some(value.bytes("runtime.Unknown.raw")?);
        }
    }
    raw.ok_or_else(|| invalid("runtime.Unknown", "no raw object"))
}

fn list_meta(message: &[u8]) -> Result<ListMeta, DecodeError> {
    let mut meta = ListMeta::default();
    for field in fields(message, "ListMeta") {
        match field? {
            (2, value) => {
                meta.resource_version = Some(value.str("ListMeta.resourceVersion")?.into())
            }
            (3, value) => meta.continue_token = Some(value.str("ListMeta.continue")?.into()),
            (4, value) => {
                meta.remaining_item_count = Some(value.varint("ListMeta.remainingItemCount")?)
            }
            _ => {}
        }
    }
    Ok(meta)
}

/// Decodes a protobuf LIST body (magic, envelope, `XList {1: metadata, 2: items}`).
pub fn decode_list<T: ProtobufRecord>(body: &[u8]) -> Result<ListPage<T>, DecodeError> {
    let mut items = Vec::new();
    let metadata = decode_list_into(body, &mut items)?;
    Ok(ListPage { metadata, items })
}

/// [`decode_list`] appending the items to `items`, so that pages can be decoded into one
/// buffer that keeps its capacity (growing a fresh vector for every page copied each record
/// about twice more). On an error `items` is as it was.
pub fn decode_list_into<T: ProtobufRecord>(
    body: &[u8],
    items: &mut Vec<T>,
) -> Result<ListMeta, DecodeError> {
    let before = items.len();
    let decoded = (|| {
        let list = unwrap_envelope(body)?;
        let mut metadata = ListMeta::default();
        for field in fields(list, "List") {
            match field? {
                (1, value) => metadata = list_meta(value.bytes("List.metadata")?)?,
                (2, value) => items.push(T::from_protobuf(value.bytes("List.items")?)?),
                _ => {}
            }
        }
        Ok(metadata)
    })();
    if decoded.is_err() {
        items.truncate(before);
    }
    decoded
}

/// A protobuf LIST page decoded while it arrives: each received chunk is decoded as far as it
/// holds whole items, and only an item cut by the chunk's end is copied, to be completed by the
/// next chunk. The page is never held whole, and its items are decoded while the rest of it is
/// still on the way. Decodes what [`decode_list`] decodes, except that a second `raw` field in
/// the envelope (never sent by kube-apiserver) is an error here rather than overriding the first.
pub struct StreamingList<T> {
    items: Vec<T>,
    metadata: ListMeta,
    at: Within,
    /// The start of a unit (a field, or the magic) that the chunks so far cut off.
    pending: Vec<u8>,
    /// Whether the list metadata came before any item (upstream's order): it then settles the
    /// continue token before the items arrive.
    metadata_first: Option<bool>,
    received: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Within {
    Magic,
    /// The fields of `runtime.Unknown`; `raw_seen` once its object has been read.
    Envelope {
        raw_seen: bool,
    },
    /// The fields of the list inside `runtime.Unknown.raw`, `left` bytes of it to come.
    List {
        left: u64,
    },
}

/// Where a unit ends, if the bytes so far tell: a varint's value and length.
fn try_varint(bytes: &[u8], what: &'static str) -> Result<Option<(u64, usize)>, DecodeError> {
    let mut value = 0u64;
    for (index, &byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * index);
        if byte < 0x80 {
            return Ok(Some((value, index + 1)));
        }
    }
    match bytes.len() >= 10 {
        true => Err(invalid(what, "bad varint")),
        false => Ok(None),
    }
}

/// The length of a field (its key and value) starting at `bytes`, `None` when `bytes` ends
/// before its header does; with `header_only` for a length-delimited field only its key and
/// length are counted (the envelope's `raw`, which is read field by field).
fn field_len(
    bytes: &[u8],
    what: &'static str,
    header_only: impl Fn(u64) -> bool,
) -> Result<Option<usize>, DecodeError> {
    let Some((key, key_len)) = try_varint(bytes, what)? else {
        return Ok(None);
    };
    let rest = &bytes[key_len..];
    let value_len = match key & 7 {
        0 => match try_varint(rest, what)? {
            Some((_, len)) => len,
            None => return Ok(None),
        },
        1 => 8,
        5 => 4,
        2 => match try_varint(rest, what)? {
            Some((_, len)) if header_only(key >> 3) => len,
            Some((len, len_len)) => usize::try_from(len)
                .ok()
                .and_then(|len| len.checked_add(len_len))
                .ok_or_else(|| invalid(what, "length overflows"))?,
            None => return Ok(None),
        },
        _ => return Err(invalid(what, "unsupported wire type (groups)")),
    };
    key_len
        .checked_add(value_len)
        .map(Some)
        .ok_or_else(|| invalid(what, "length overflows"))
}

impl<T: ProtobufRecord> StreamingList<T> {
    /// Room for `capacity` items is made up front (a page's size): growing by doubling would
    /// copy the records several times.
    pub fn new(capacity: usize) -> Self {
        Self {
            items: Vec::with_capacity(capacity),
            metadata: ListMeta::default(),
            at: Within::Magic,
            pending: Vec::new(),
            metadata_first: None,
            received: 0,
        }
    }

    /// Decodes what `chunk`, the next bytes of the body, completes.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Result<(), DecodeError> {
        self.received += chunk.len();
        // First the unit the previous chunks cut off: its header byte by byte (at most 20),
        // then exactly the rest of it, so that `pending` never holds more than one unit.
        while !self.pending.is_empty() {
            match self.unit_len(&self.pending)? {
                Some(len) => {
                    let take = (len - self.pending.len()).min(chunk.len());
                    self.pending.extend_from_slice(&chunk[..take]);
                    chunk = &chunk[take..];
                    if self.pending.len() < len {
                        return Ok(());
                    }
                    let unit = std::mem::take(&mut self.pending);
                    self.consume(&unit)?;
                    // The buffer is kept for the next cut unit.
                    self.pending = unit;
                    self.pending.clear();
                    break;
                }
                None => {
                    let Some((&byte, rest)) = chunk.split_first() else {
                        return Ok(());
                    };
                    self.pending.push(byte);
                    chunk = rest;
                }
            }
        }
        loop {
            match self.unit_len(chunk)? {
                Some(len) if len <= chunk.len() => {
                    let (unit, rest) = chunk.split_at(len);
                    self.consume(unit)?;
                    chunk = rest;
                }
                _ => {
                    self.pending.extend_from_slice(chunk);
                    return Ok(());
                }
            }
        }
    }

    /// The length of the unit starting at `bytes` (which may hold more), if known yet.
    fn unit_len(&self, bytes: &[u8]) -> Result<Option<usize>, DecodeError> {
        match self.at {
            Within::Magic => Ok(Some(MAGIC.len())),
            Within::Envelope { .. } => field_len(bytes, "runtime.Unknown", |number| number == 2),
            Within::List { left } => {
                let left = usize::try_from(left).unwrap_or(usize::MAX);
                let within = &bytes[..bytes.len().min(left)];
                match field_len(within, "List", |_| false)? {
                    Some(len) if len > left => Err(invalid(
                        "List",
                        "field runs past the end of runtime.Unknown.raw",
                    )),
                    None if within.len() == left => Err(invalid(
                        "List",
                        "field runs past the end of runtime.Unknown.raw",
                    )),
                    found => Ok(found),
                }
            }
        }
    }

    /// Decodes one whole unit.
    fn consume(&mut self, unit: &[u8]) -> Result<(), DecodeError> {
        match self.at {
            Within::Magic => {
                if unit != MAGIC {
                    return Err(invalid("body", "missing the k8s\\0 prefix"));
                }
                self.at = Within::Envelope { raw_seen: false };
            }
            Within::Envelope { raw_seen } => {
                let mut header = unit;
                if varint(&mut header, "runtime.Unknown")? == (2 << 3) | 2 {
                    if raw_seen {
                        return Err(invalid("runtime.Unknown", "more than one raw object"));
                    }
                    self.at = match varint(&mut header, "runtime.Unknown.raw")? {
                        0 => Within::Envelope { raw_seen: true },
                        left => Within::List { left },
                    };
                } else {
                    // Another field of the envelope (type meta, content type): not needed.
                    fields(unit, "runtime.Unknown").read()?;
                }
            }
            Within::List { left } => {
                for field in fields(unit, "List") {
                    match field? {
                        (1, value) => {
                            self.metadata = list_meta(value.bytes("List.metadata")?)?;
                            self.metadata_first.get_or_insert(true);
                        }
                        (2, value) => {
                            self.items
                                .push(T::from_protobuf(value.bytes("List.items")?)?);
                            self.metadata_first.get_or_insert(false);
                        }
                        _ => {}
                    }
                }
                // `unit_len` kept the unit within `left`.
                let left = left - unit.len() as u64;
                self.at = match left {
                    0 => Within::Envelope { raw_seen: true },
                    left => Within::List { left },
                };
            }
        }
        Ok(())
    }

    /// The continue token once the bytes so far settle it, as [`early_continue_token`]: when
    /// the list metadata came before the items, from then on (`Some(None)`: the last page).
    pub fn early_continue_token(&self) -> Option<Option<&str>> {
        (self.metadata_first == Some(true)).then(|| {
            self.metadata
                .continue_token
                .as_deref()
                .filter(|token| !token.is_empty())
        })
    }

    /// How many bytes of the body were fed.
    pub fn received(&self) -> usize {
        self.received
    }

    /// The items and the list metadata, once the body is complete.
    pub fn finish(self) -> Result<ListPage<T>, DecodeError> {
        if !self.pending.is_empty() || self.at != (Within::Envelope { raw_seen: true }) {
            return Err(match self.at {
                Within::Envelope { raw_seen: true } | Within::List { .. } => {
                    invalid("body", "cut off before its end")
                }
                Within::Magic if self.pending.is_empty() => invalid("body", "empty"),
                Within::Magic => invalid("body", "missing the k8s\\0 prefix"),
                Within::Envelope { raw_seen: false } => invalid("runtime.Unknown", "no raw object"),
            });
        }
        Ok(ListPage {
            metadata: self.metadata,
            items: self.items,
        })
    }
}

/// The continue token from the first bytes of a protobuf LIST page, when they settle it:
/// upstream writes fields in number order, so the list metadata (field 1) precedes the items.
/// `Some(None)`: the metadata is complete and has no token (the last page); `None`: the bytes
/// so far do not tell.
pub fn early_continue_token(prefix: &[u8]) -> Option<Option<String>> {
    let mut unknown = fields(prefix.strip_prefix(MAGIC)?, "runtime.Unknown");
    loop {
        // A field cut off by the end of the prefix fails to read: not settled yet.
        let before = unknown.rest;
        match unknown.read() {
            Ok((2, Value::Bytes(_))) | Err(_) => {
                // `raw` started at `before`; read its header by hand since it may be cut off.
                let mut rest = before;
                let key = varint(&mut rest, "runtime.Unknown").ok()?;
                if key != (2 << 3) | 2 {
                    return None;
                }
                varint(&mut rest, "runtime.Unknown.raw").ok()?;
                let mut list = fields(rest, "List");
                let (number, value) = list.read().ok()?;
                if number != 1 {
                    // Items before metadata: not upstream's layout, nothing to settle early.
                    return None;
                }
                let meta = list_meta(value.bytes("List.metadata").ok()?).ok()?;
                return Some(meta.continue_token.filter(|token| !token.is_empty()));
            }
            Ok(_) => continue,
        }
    }
}

/// An error `Status` in protobuf, as kube-apiserver answers requests that accept it.
pub fn decode_status(body: &[u8]) -> Option<kube::core::Status> {
    let status = unwrap_envelope(body).ok()?;
    let (mut code, mut message, mut reason, mut state) =
        (0u16, String::new(), String::new(), String::new());
    for field in fields(status, "Status") {
        match field.ok()? {
            (2, value) => state = value.str("Status.status").ok()?.to_owned(),
            (3, value) => message = value.str("Status.message").ok()?.to_owned(),
            (4, value) => reason = value.str("Status.reason").ok()?.to_owned(),
            (6, value) => code = u16::try_from(value.varint("Status.code").ok()?).ok()?,
            _ => {}
        }
    }
    let mut decoded = kube::core::Status::failure(&message, &reason).with_code(code);
    if state == "Success" {
        decoded.status = Some(kube::core::response::StatusSummary::Success);
    }
    Some(decoded)
}

/// `metav1.Time`: `{1: seconds, 2: nanos}`; an empty message is the zero time (unset).
fn time(message: &[u8]) -> Result<Option<jiff::Timestamp>, DecodeError> {
    if message.is_empty() {
        return Ok(None);
    }
    let mut seconds = 0i64;
    for field in fields(message, "Time") {
        if let (1, value) = field? {
            seconds = value.varint("Time.seconds")? as i64;
        }
    }
    Ok(jiff::Timestamp::from_second(seconds).ok())
}

impl ProtobufRecord for ServiceRecord {
    /// Straight into the record, like [`IpAddressRecord`]'s, with the same conversions as the
    /// JSON path's `wire::Service` (the fixture tests hold both to the same records). Texts with
    /// a canonical shape (uid, resourceVersion, cluster IPs) are read as bytes, so only the names
    /// and the rare other texts are checked for UTF-8.
    fn from_protobuf(message: &[u8]) -> Result<Self, DecodeError> {
        let utf8 = |what| move |_| invalid(what, "string is not UTF-8");
        let (mut name, mut namespace, mut uid): (&[u8], &[u8], &[u8]) = (b"", b"", b"");
        let mut resource_version: Option<&[u8]> = None;
        let mut cluster_ip: Option<&[u8]> = None;
        let mut cluster_ips = ClusterIps::new();
        let mut node_ports = Vec::new();
        let mut health_check_node_port = 0;
        let mut created = None;
        for field in fields(message, "Service") {
            match field? {
                (1, value) => {
                    // Once the five fields are read, the rest of the metadata (labels,
                    // annotations, managedFields) is not even walked: kube-apiserver writes each
                    // field once.
                    const WANTED: u16 = 1 << 1 | 1 << 3 | 1 << 5 | 1 << 6 | 1 << 8;
                    let mut seen = 0u16;
                    for field in fields(value.bytes("Service.metadata")?, "ObjectMeta") {
                        let (number, v) = field?;
                        match number {
                            1 => name = v.bytes("ObjectMeta.name")?,
                            3 => namespace = v.bytes("ObjectMeta.namespace")?,
                            5 => uid = v.bytes("ObjectMeta.uid")?,
                            6 => resource_version = Some(v.bytes("ObjectMeta.resourceVersion")?),
                            8 => created = time(v.bytes("ObjectMeta.creationTimestamp")?)?,
                            _ => continue,
                        }
                        seen |= 1 << number;
                        if seen == WANTED {
                            break;
                        }
                    }
                }
                (2, value) => {
                    for field in fields(value.bytes("Service.spec")?, "ServiceSpec") {
                        match field? {
                            (3, v) => {
                                let text = v.bytes("ServiceSpec.clusterIP")?;
                                if !text.is_ascii() {
                                    std::str::from_utf8(text)
                                        .map_err(utf8("ServiceSpec.clusterIP"))?;
                                }
                                cluster_ip = Some(text);
                            }
                            (18, v) => cluster_ips.push(
                                ClusterIp::from_bytes(v.bytes("ServiceSpec.clusterIPs")?)
                                    .map_err(utf8("ServiceSpec.clusterIPs"))?,
                            ),
                            (1, v) => {
                                let (mut node_port, mut protocol) = (0, Protocol::Tcp);
                                for field in fields(v.bytes("ServiceSpec.ports")?, "ServicePort") {
                                    match field? {
                                        (2, v) => {
                                            protocol = Protocol::from_bytes(
                                                v.bytes("ServicePort.protocol")?,
                                            );
                                        }
                                        (5, v) => {
                                            node_port = int32(v.varint("ServicePort.nodePort")?)
                                        }
                                        _ => {}
                                    }
                                }
                                if node_port != 0 {
                                    node_ports.push((node_port, protocol));
                                }
                            }
                            (12, v) => {
                                health_check_node_port =
                                    int32(v.varint("ServiceSpec.healthCheckNodePort")?);
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        // upstream's IsServiceIPSet, as in `wire::Service`'s conversion.
        let has_ip = cluster_ip.is_some_and(|ip| !ip.is_empty() && ip != b"None");
        let cluster_ips = match (has_ip, cluster_ip) {
            (false, _) => ClusterIps::new(),
            (true, _) if !cluster_ips.is_empty() => cluster_ips,
            (true, ip) => ip
                .map(ClusterIp::from_bytes)
                .transpose()
                .map_err(utf8("ServiceSpec.clusterIP"))?
                .into_iter()
                .collect(),
        };
        Ok(ServiceRecord {
            namespace: Name::from_utf8(namespace).map_err(utf8("ObjectMeta.namespace"))?,
            name: Name::from_utf8(name).map_err(utf8("ObjectMeta.name"))?,
            uid: Token::from_bytes(uid).map_err(utf8("ObjectMeta.uid"))?,
            resource_version: resource_version
                .map(resource_version_number)
                .transpose()
                .map_err(utf8("ObjectMeta.resourceVersion"))?
                .unwrap_or(0),
            cluster_ips,
            node_ports: node_ports.into_boxed_slice(),
            health_check_node_port,
            created,
        })
    }
}

/// An `int32` field: protobuf writes negative values as ten-byte varints of their 64-bit two's
/// complement, so the low 32 bits are the value.
fn int32(varint: u64) -> i32 {
    varint as u32 as i32
}

/// `bytes` as text: a `known` one without a UTF-8 check (the usual values), else checked.
#[inline(always)]
fn known_or_str<'b>(
    bytes: &'b [u8],
    known: fn(&[u8]) -> Option<&'static str>,
    what: &'static str,
) -> Result<&'b str, DecodeError> {
    match known(bytes) {
        Some(known) => Ok(known),
        None => std::str::from_utf8(bytes).map_err(|_| invalid(what, "string is not UTF-8")),
    }
}

const MANAGED_BY_KEY: &[u8; LABEL_MANAGED_BY.len()] = array(LABEL_MANAGED_BY);
const IP_FAMILY_KEY: &[u8; LABEL_IP_FAMILY.len()] = array(LABEL_IP_FAMILY);

/// The fields of `ParentReference`, by number.
const PARENT_FIELDS: [&str; 4] = [
    "ParentReference.group",
    "ParentReference.resource",
    "ParentReference.namespace",
    "ParentReference.name",
];

impl ProtobufRecord for IpAddressRecord {
    /// Straight into the record, without the borrowed wire struct the JSON path fills: 130,000
    /// of these per LIST, on the list that usually finishes last. Texts only compared with
    /// constants (label keys and values, the parent's group and resource) are compared as bytes,
    /// so only texts that are kept are checked for UTF-8. `protobuf_and_json_fixtures_decode_to_
    /// the_same_records` and `ipaddresses_decode_alike_from_both_encodings` hold both paths to the
    /// same records.
    #[inline]
    fn from_protobuf(message: &[u8]) -> Result<Self, DecodeError> {
        let utf8 = |what| move |_| invalid(what, "string is not UTF-8");
        let (mut name, mut uid, mut resource_version): (&[u8], &[u8], &[u8]) = (b"", b"", b"");
        let (mut labels, mut parent) = (IpLabels::default(), None);
        let (mut created, mut deleting) = (None, false);
        for field in fields(message, "IPAddress") {
            match field? {
                (1, value) => {
                    for field in fields(value.bytes("IPAddress.metadata")?, "ObjectMeta") {
                        match field? {
                            (1, v) => name = v.bytes("ObjectMeta.name")?,
                            (5, v) => uid = v.bytes("ObjectMeta.uid")?,
                            (6, v) => resource_version = v.bytes("ObjectMeta.resourceVersion")?,
                            (8, v) => created = time(v.bytes("ObjectMeta.creationTimestamp")?)?,
                            (9, v) => {
                                // A pointer field in Go: present means set.
                                v.bytes("ObjectMeta.deletionTimestamp")?;
                                deleting = true;
                            }
                            (11, v) => {
                                let (mut key, mut text): (&[u8], &[u8]) = (b"", b"");
                                for field in fields(v.bytes("ObjectMeta.labels")?, "labels entry") {
                                    match field? {
                                        (1, v) => key = v.bytes("ObjectMeta.labels key")?,
                                        (2, v) => text = v.bytes("ObjectMeta.labels value")?,
                                        _ => {}
                                    }
                                }
                                type Known = fn(&[u8]) -> Option<&'static str>;
                                let (set, known): (fn(&mut IpLabels, Option<&str>), Known) =
                                    match key {
                                        k if equals(k, MANAGED_BY_KEY) => {
                                            (IpLabels::set_managed_by, known_manager)
                                        }
                                        k if equals(k, IP_FAMILY_KEY) => {
                                            (IpLabels::set_family, known_family)
                                        }
                                        _ => continue,
                                    };
                                set(
                                    &mut labels,
                                    Some(known_or_str(text, known, "ObjectMeta.labels value")?),
                                );
                            }
                            _ => {}
                        }
                    }
                }
                (2, value) => {
                    for field in fields(value.bytes("IPAddress.spec")?, "IPAddressSpec") {
                        if let (1, v) = field? {
                            // A message field met twice is merged, as Go's decoder does.
                            let texts = parent.get_or_insert([&b""[..]; 4]);
                            for field in
                                fields(v.bytes("IPAddressSpec.parentRef")?, "ParentReference")
                            {
                                let (number, v) = field?;
                                if let Some(at) = (number as usize).checked_sub(1)
                                    && let Some(slot) = texts.get_mut(at)
                                {
                                    *slot = v.bytes(PARENT_FIELDS[at])?;
                                }
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        let parent = match parent {
            Some([group, resource, namespace, name]) => Some(ParentRef::new(
                known_or_str(group, known_group, PARENT_FIELDS[0])?,
                known_or_str(resource, known_resource, PARENT_FIELDS[1])?,
                Name::from_utf8(namespace).map_err(utf8(PARENT_FIELDS[2]))?,
                Name::from_utf8(name).map_err(utf8(PARENT_FIELDS[3]))?,
            )),
            None => None,
        };
        Ok(IpAddressRecord {
            name: IpName::from_bytes(name).map_err(utf8("ObjectMeta.name"))?,
            uid: Token::from_bytes(uid).map_err(utf8("ObjectMeta.uid"))?,
            resource_version: Token::from_bytes(resource_version)
                .map_err(utf8("ObjectMeta.resourceVersion"))?,
            labels,
            parent,
            created,
            deleting,
        })
    }
}

impl ProtobufRecord for ServiceCidrRecord {
    fn from_protobuf(message: &[u8]) -> Result<Self, DecodeError> {
        let mut cidr = wire::ServiceCidr::default();
        for field in fields(message, "ServiceCIDR") {
            match field? {
                (1, value) => {
                    for field in fields(value.bytes("ServiceCIDR.metadata")?, "ObjectMeta") {
                        match field? {
                            (1, v) => cidr.metadata.name = Cow::Borrowed(v.str("ObjectMeta.name")?),
                            (6, v) => {
                                cidr.metadata.resource_version =
                                    Some(Cow::Borrowed(v.str("ObjectMeta.resourceVersion")?))
                            }
                            (9, v) => {
                                v.bytes("ObjectMeta.deletionTimestamp")?;
                                cidr.metadata.deletion_timestamp = Some(Cow::Borrowed(""));
                            }
                            _ => {}
                        }
                    }
                }
                (2, value) => {
                    for field in fields(value.bytes("ServiceCIDR.spec")?, "ServiceCIDRSpec") {
                        if let (1, v) = field? {
                            cidr.spec
                                .cidrs
                                .push(Cow::Borrowed(v.str("ServiceCIDRSpec.cidrs")?));
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(cidr.into())
    }
}

/// Protobuf bodies built field by field, for tests here and in the reflector.
#[cfg(test)]
pub(crate) mod test_bodies {
    use super::MAGIC;

    /// A length-delimited field.
    pub(crate) fn push_field(out: &mut Vec<u8>, number: u64, value: &[u8]) {
        prost::encoding::encode_varint((number << 3) | 2, out);
        prost::encoding::encode_varint(value.len() as u64, out);
        out.extend_from_slice(value);
    }

    /// A protobuf LIST body with the list's `fields` in the order given (`(1, metadata)`,
    /// `(2, item)`): magic, `runtime.Unknown` with the list in `raw` and the (empty) content
    /// encoding and type after it, as kube-apiserver writes them.
    pub(crate) fn list_body_of(fields: &[(u64, &[u8])]) -> Vec<u8> {
        let mut list = Vec::new();
        for (number, value) in fields {
            push_field(&mut list, *number, value);
        }
        let mut body = MAGIC.to_vec();
        push_field(
            &mut body,
            1,
            &[0x0a, 2, b'v', b'1', 0x12, 4, b'L', b'i', b's', b't'],
        );
        push_field(&mut body, 2, &list);
        push_field(&mut body, 3, b"");
        push_field(&mut body, 4, b"");
        body
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/k8s-api");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
    }

    /// Upstream's fixtures, where every field is set: protobuf and JSON give the same record.
    #[test]
    fn protobuf_and_json_fixtures_decode_to_the_same_records() {
        let pb = fixture("core.v1.Service.pb");
        let json: ServiceRecord = serde_json::from_slice(&fixture("core.v1.Service.json")).unwrap();
        assert_eq!(
            ServiceRecord::from_protobuf(unwrap_envelope(&pb).unwrap()).unwrap(),
            json
        );
        assert_eq!(&*json.node_ports, &[(5, Protocol::Other)]);
        assert_eq!(json.health_check_node_port, 12);

        let pb = fixture("networking.k8s.io.v1.IPAddress.pb");
        let json: IpAddressRecord =
            serde_json::from_slice(&fixture("networking.k8s.io.v1.IPAddress.json")).unwrap();
        let decoded = IpAddressRecord::from_protobuf(unwrap_envelope(&pb).unwrap()).unwrap();
        assert_eq!(decoded, json);
        assert!(decoded.created.is_some() && decoded.deleting && decoded.parent.is_some());

        let pb = fixture("networking.k8s.io.v1.ServiceCIDR.pb");
        let json: ServiceCidrRecord =
            serde_json::from_slice(&fixture("networking.k8s.io.v1.ServiceCIDR.json")).unwrap();
        assert_eq!(
            ServiceCidrRecord::from_protobuf(unwrap_envelope(&pb).unwrap()).unwrap(),
            json
        );
    }

    /// The protobuf path decodes Services straight into records, the JSON path through
    /// `wire::Service`: both must give the same record for every shape of spec and metadata.
    #[test]
    fn services_decode_alike_from_both_encodings() {
        use serde_json::json;
        let specs = [
            json!({}),
            json!({"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"]}),
            json!({"clusterIP": "10.96.0.10"}),
            json!({"clusterIP": "fd00:10:96::a", "clusterIPs": ["fd00:10:96::a", "10.96.0.11"]}),
            json!({"clusterIP": "None", "clusterIPs": ["None"]}),
            json!({"clusterIP": "", "clusterIPs": ["10.96.0.12"]}),
            json!({"clusterIP": "010.096.000.013", "clusterIPs": ["010.096.000.013"]}),
            json!({"clusterIP": "FD00::1", "clusterIPs": ["FD00::1", "::ffff:10.96.0.14"]}),
            json!({"clusterIP": "fd00:0:0:0:0:0:0:1"}),
            json!({"clusterIP": "not-an-ip", "clusterIPs": ["not-an-ip", "10.96.0.15"]}),
            json!({"clusterIP": "10.96.0.16", "clusterIPs": []}),
            json!({"type": "NodePort", "clusterIP": "10.96.0.17", "ports": [
                {"port": 80, "protocol": "TCP", "nodePort": 30080},
                {"port": 53, "protocol": "UDP", "nodePort": 30080},
                {"port": 54, "nodePort": 30081},
                {"port": 81, "protocol": "SCTP"},
            ]}),
            json!({"type": "LoadBalancer", "healthCheckNodePort": 32000, "ports": [
                {"port": 443, "protocol": "TCP", "nodePort": -5},
                {"port": 444, "protocol": "ODD", "nodePort": 70000},
            ]}),
        ];
        let metas = [
            json!({"name": "web", "namespace": "default", "uid": "6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f", "resourceVersion": "12345"}),
            json!({"name": "a-service-name-longer-than-24-bytes", "namespace": "ns", "uid": "uid-odd", "resourceVersion": "0012"}),
            json!({"name": "x", "namespace": "ns", "uid": "", "resourceVersion": "not-a-number"}),
            json!({"name": "ünïcode", "namespace": "ns"}),
        ];
        let mut checked = 0;
        for (m, metadata) in metas.iter().enumerate() {
            for (p, spec) in specs.iter().enumerate() {
                let object = json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": metadata,
                    "spec": spec,
                });
                let pb = apiserver_sim::protobuf::encode_object("Service", &object).unwrap();
                let from_json: ServiceRecord = serde_json::from_value(object).unwrap();
                let from_pb = ServiceRecord::from_protobuf(&pb).unwrap();
                assert_eq!(from_pb, from_json, "metadata {m} spec {p}");
                checked += 1;
            }
        }
        assert_eq!(checked, 52);
    }

    /// Texts kept from a Service are checked for UTF-8 even on the byte-reading fast paths.
    #[test]
    fn services_with_invalid_utf8_are_errors() {
        use serde_json::json;
        let object = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "default", "uid": "u", "resourceVersion": "1"},
            "spec": {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"]},
        });
        let pb = apiserver_sim::protobuf::encode_object("Service", &object).unwrap();
        assert!(ServiceRecord::from_protobuf(&pb).is_ok());
        for field in [&b"web"[..], b"default", b"10.96.0.10"] {
            let at = pb
                .windows(field.len())
                .position(|window| window == field)
                .unwrap();
            let mut corrupt = pb.clone();
            corrupt[at] = 0xff;
            assert!(
                ServiceRecord::from_protobuf(&corrupt).is_err(),
                "{}",
                String::from_utf8_lossy(field)
            );
        }
    }

    /// IPAddresses of every shape the repair tells apart decode to the same record from
    /// protobuf (the direct path) as from JSON (the wire structs).
    #[test]
    fn ipaddresses_decode_alike_from_both_encodings() {
        use serde_json::json;
        let parents = [
            json!(null),
            json!({"group": "", "resource": "services", "namespace": "default", "name": "web"}),
            json!({"resource": "services", "namespace": "a-namespace-longer-than-24-bytes", "name": "a-service-name-longer-than-24-bytes"}),
            json!({"group": "example.com", "resource": "gateways", "namespace": "ns", "name": "gw"}),
            json!({"resource": "", "namespace": "", "name": ""}),
        ];
        let label_sets = [
            json!({}),
            json!({"ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io", "ipaddress.kubernetes.io/ip-family": "IPv4"}),
            json!({"ipaddress.kubernetes.io/managed-by": "someone-else", "ipaddress.kubernetes.io/ip-family": "IPv7", "other": "x"}),
            json!({"ipaddress.kubernetes.io/ip-family": "IPv6"}),
        ];
        let names = [
            "10.96.0.1",
            "fd00:10:96::a",
            "FD00::1",
            "010.0.0.1",
            "not-an-ip",
        ];
        let mut checked = 0;
        for (n, name) in names.iter().enumerate() {
            for (p, parent) in parents.iter().enumerate() {
                for (l, labels) in label_sets.iter().enumerate() {
                    let mut object = json!({
                        "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
                        "metadata": {
                            "name": name,
                            "uid": if n % 2 == 0 { "6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f" } else { "uid-odd" },
                            "resourceVersion": if l % 2 == 0 { "12345" } else { "0012" },
                            "labels": labels,
                        },
                        "spec": {},
                    });
                    if !parent.is_null() {
                        object["spec"]["parentRef"] = parent.clone();
                    }
                    if p % 2 == 1 {
                        object["metadata"]["creationTimestamp"] = json!("2026-01-02T03:04:05Z");
                    }
                    if l == 2 {
                        object["metadata"]["deletionTimestamp"] = json!("2026-01-02T03:04:06Z");
                    }
                    let pb = apiserver_sim::protobuf::encode_object("IPAddress", &object).unwrap();
                    let from_json: IpAddressRecord = serde_json::from_value(object).unwrap();
                    let from_pb = IpAddressRecord::from_protobuf(&pb).unwrap();
                    assert_eq!(from_pb, from_json, "{name} parent {p} labels {l}");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 100);
    }

    /// Every cut of a valid body fails cleanly (no panic, no partial record passed as whole).
    #[test]
    fn truncated_bodies_are_errors() {
        let pb = fixture("core.v1.Service.pb");
        let raw = unwrap_envelope(&pb).unwrap();
        for cut in 0..raw.len() {
            let _ = ServiceRecord::from_protobuf(&raw[..cut]);
        }
        let whole = ServiceRecord::from_protobuf(raw).unwrap();
        for cut in 0..pb.len() {
            // A cut on a field boundary after the object is still the whole object.
            if let Ok(raw) = unwrap_envelope(&pb[..cut])
                && let Ok(record) = ServiceRecord::from_protobuf(raw)
            {
                assert_eq!(record, whole, "cut at {cut}");
            }
        }
        assert!(decode_list::<ServiceRecord>(b"{\"kind\":\"ServiceList\"}").is_err());
        assert!(decode_list::<ServiceRecord>(b"k8s\0\x12\xff").is_err());
    }

    #[test]
    fn early_token_needs_the_whole_list_metadata() {
        // k8s\0, typeMeta, raw = ServiceList {1: ListMeta {2: "7", 3: "next", 4: 1234}, 2: ...}.
        let meta = [
            0x12, 1, b'7', 0x1a, 4, b'n', b'e', b'x', b't', 0x20, 0xd2, 0x09,
        ];
        let mut list = vec![0x0a, meta.len() as u8];
        list.extend_from_slice(&meta);
        // One item: ServiceCIDR {1: ObjectMeta {1: "x"}}.
        let item = [0x12, 5, 0x0a, 3, 0x0a, 1, b'x'];
        list.extend_from_slice(&item);
        let mut body = b"k8s\0".to_vec();
        body.extend_from_slice(&[0x0a, 4, 0x0a, 0, 0x12, 0]);
        body.extend_from_slice(&[0x12, list.len() as u8]);
        body.extend_from_slice(&list);
        let whole = early_continue_token(&body);
        assert_eq!(whole, Some(Some("next".to_owned())));
        let settled_at = body.len() - item.len();
        for cut in 0..settled_at {
            assert_eq!(early_continue_token(&body[..cut]), None, "cut at {cut}");
        }
        assert_eq!(early_continue_token(&body[..settled_at]), whole);
        let page = decode_list::<ServiceCidrRecord>(&body).unwrap();
        assert_eq!(page.metadata.continue_token.as_deref(), Some("next"));
        assert_eq!(page.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(page.metadata.remaining_item_count, Some(1234));
        assert_eq!(&*page.items[0].name, "x");
        let json: ListPage<ServiceCidrRecord> = serde_json::from_str(
            r#"{"metadata":{"resourceVersion":"7","continue":"next","remainingItemCount":1234}}"#,
        )
        .unwrap();
        assert_eq!(json.metadata.remaining_item_count, Some(1234));
    }

    use super::test_bodies::{list_body_of, push_field};

    /// A protobuf LIST body as kube-apiserver writes it, or with the metadata last.
    fn list_body(meta: &[u8], items: &[&[u8]], meta_first: bool) -> Vec<u8> {
        let mut fields: Vec<(u64, &[u8])> = items.iter().map(|item| (2, *item)).collect();
        match meta_first {
            true => fields.insert(0, (1, meta)),
            false => fields.push((1, meta)),
        }
        list_body_of(&fields)
    }

    fn streamed<T: ProtobufRecord>(chunks: &[&[u8]]) -> Result<ListPage<T>, DecodeError> {
        let mut list = StreamingList::new(4);
        for chunk in chunks {
            list.feed(chunk)?;
        }
        list.finish()
    }

    /// However the body is cut into chunks, the streaming decoder gives what the whole-body
    /// decoder gives, and settles the continue token once the list metadata is complete.
    #[test]
    fn streaming_decode_matches_the_whole_body_at_every_cut() {
        let pb = fixture("core.v1.Service.pb");
        let service = unwrap_envelope(&pb).unwrap();
        let meta = [0x12, 1, b'7', 0x1a, 4, b'n', b'e', b'x', b't', 0x20, 0x02];
        let body = list_body(&meta, &[service, service, service], true);
        let whole = decode_list::<ServiceRecord>(&body).unwrap();
        assert_eq!(whole.items.len(), 3);
        let expected = (whole.items, whole.metadata.continue_token);
        let meta_ends = body.windows(meta.len()).position(|w| w == meta).unwrap() + meta.len();
        for cut in 0..=body.len() {
            let (head, tail) = body.split_at(cut);
            let page = streamed::<ServiceRecord>(&[head, tail]).unwrap();
            assert_eq!(
                (page.items, page.metadata.continue_token),
                expected,
                "cut at {cut}"
            );
            let mut list = StreamingList::<ServiceRecord>::new(0);
            list.feed(head).unwrap();
            let settled = list.early_continue_token().map(|t| t.map(str::to_owned));
            match cut >= meta_ends {
                true => assert_eq!(settled, Some(Some("next".to_owned())), "cut at {cut}"),
                false => assert_eq!(settled, None, "cut at {cut}"),
            }
        }
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        let page = streamed::<ServiceRecord>(&bytes).unwrap();
        assert_eq!((page.items, page.metadata.continue_token), expected);
        for size in [2, 3, 7, 64, 500] {
            let chunks: Vec<&[u8]> = body.chunks(size).collect();
            let page = streamed::<ServiceRecord>(&chunks).unwrap();
            assert_eq!(page.items, expected.0, "chunks of {size}");
        }
    }

    /// Metadata after the items (not upstream's order) settles the token only at the end.
    #[test]
    fn streaming_decode_with_metadata_last() {
        let item = [0x0a, 3, 0x0a, 1, b'x'];
        let meta = [0x1a, 4, b'n', b'e', b'x', b't'];
        let body = list_body(&meta, &[&item], false);
        let mut list = StreamingList::<ServiceCidrRecord>::new(1);
        list.feed(&body).unwrap();
        assert_eq!(list.early_continue_token(), None);
        let page = list.finish().unwrap();
        assert_eq!(page.metadata.continue_token.as_deref(), Some("next"));
        assert_eq!(&*page.items[0].name, "x");
        // The last page: metadata first, no token.
        let body = list_body(&[0x12, 1, b'9'], &[&item], true);
        let mut list = StreamingList::<ServiceCidrRecord>::new(1);
        list.feed(&body[..body.len() - 11]).unwrap();
        assert_eq!(list.early_continue_token(), Some(None));
    }

    /// Cut-off, oversized and malformed bodies are errors, whatever the chunking; never a panic.
    #[test]
    fn streaming_decode_rejects_bad_bodies() {
        let item = [0x0a, 3, 0x0a, 1, b'x'];
        let body = list_body(&[0x12, 1, b'9'], &[&item, &item], true);
        // Cut anywhere before the end of `raw` (the two empty fields after it may go).
        for cut in 0..body.len() - 4 {
            let (head, _) = body.split_at(cut);
            let one: Vec<&[u8]> = head.chunks(1).collect();
            assert!(
                streamed::<ServiceCidrRecord>(&[head]).is_err(),
                "cut at {cut}"
            );
            assert!(streamed::<ServiceCidrRecord>(&one).is_err(), "cut at {cut}");
        }
        // Not protobuf at all.
        assert!(streamed::<ServiceRecord>(&[b"{\"kind\":\"ServiceList\"}"]).is_err());
        // `raw` claims more than the body holds.
        assert!(streamed::<ServiceRecord>(&[b"k8s\0\x12\xff\x01\x0a"]).is_err());
        // An item runs past the end of `raw`.
        let mut list = Vec::new();
        push_field(&mut list, 2, &item);
        let mut body = MAGIC.to_vec();
        push_field(&mut body, 2, &list[..list.len() - 2]);
        body.extend_from_slice(&list[list.len() - 2..]);
        assert!(streamed::<ServiceCidrRecord>(&[&body]).is_err());
        // Two objects in one envelope.
        let mut body = MAGIC.to_vec();
        push_field(&mut body, 2, &list);
        push_field(&mut body, 2, &list);
        assert!(streamed::<ServiceCidrRecord>(&[&body]).is_err());
        assert!(decode_list::<ServiceCidrRecord>(&body).is_ok());
        // A varint that never ends.
        let mut body = MAGIC.to_vec();
        body.extend_from_slice(&[0xff; 12]);
        assert!(streamed::<ServiceCidrRecord>(&[&body]).is_err());
        // An item that is not a valid object.
        let mut list = Vec::new();
        push_field(&mut list, 2, &[0x0a, 9, 0x0a]);
        let mut body = MAGIC.to_vec();
        push_field(&mut body, 2, &list);
        assert!(streamed::<ServiceCidrRecord>(&[&body]).is_err());
    }
}
