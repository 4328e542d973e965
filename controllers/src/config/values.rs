//! Value types and their parsers: service ranges, numbers, lists (the node port range is
//! [`reconcilers::alloc::PortRange`]).

use ipnet::IpNet;
use serde::Deserialize;

/// `Err` holds the text that is no number, for the message.
pub(super) fn parse_u32(text: &str) -> Result<u32, NotANumber> {
    text.trim()
        .parse::<u32>()
        .map_err(|_| NotANumber(text.to_owned()))
}

/// `Err` holds the text that is no number, for the message.
pub(super) fn parse_i64(text: &str) -> Result<i64, NotANumber> {
    text.trim()
        .parse::<i64>()
        .map_err(|_| NotANumber(text.to_owned()))
}

/// Parses a boolean flag or variable: `true` or `false`, as clap's own parser took them. Parsed
/// here rather than by clap so that a bad value is reported with the others, naming the variable
/// when it came from the environment.
pub(super) fn parse_bool(text: &str) -> Result<bool, NotABool> {
    match text.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(NotABool(text.to_owned())),
    }
}

/// A flag's text that is not `true` or `false`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotABool(pub String);

impl std::fmt::Display for NotABool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} is not a boolean (expected true or false)", self.0)
    }
}

/// A flag's text that is not a number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotANumber(pub String);

/// `serviceClusterIPRange` (and the other lists) may be written `"a,b"` (like the flag) or as a
/// YAML list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    List(Vec<String>),
}

impl StringOrList {
    pub(super) fn joined(&self) -> String {
        match self {
            StringOrList::One(one) => one.clone(),
            StringOrList::List(list) => list.join(","),
        }
    }
}

/// The file's list as the flag writes it.
impl From<StringOrList> for String {
    fn from(list: StringOrList) -> String {
        list.joined()
    }
}

/// A flag's or field's value that does not parse; the message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error(
        "is empty (expected one CIDR such as 10.96.0.0/12, or two of different families such as 10.96.0.0/12,fd00:10:96::/108)"
    )]
    NoCidr,
    #[error("{0:?} is not a valid CIDR (expected e.g. 10.96.0.0/12 or fd00:10:96::/108)")]
    NotACidr(String),
    #[error("{text:?} has host bits set (did you mean {network}?)")]
    HostBits { text: String, network: IpNet },
    /// Parsed, but not a usable set of service ranges: the message of
    /// [`reconcilers::service_range::RangeError`].
    #[error("{0}")]
    Ranges(String),
}

/// Parses `--service-cluster-ip-range`: one CIDR, or two of different families, each holding at
/// least 8 addresses (kube-apiserver's rules, checked by
/// [`reconcilers::service_range::validate_ranges`]).
pub fn parse_service_cidrs(text: &str) -> Result<Vec<IpNet>, ValueError> {
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    if parts.iter().all(|part| part.is_empty()) {
        return Err(ValueError::NoCidr);
    }
    let mut cidrs = Vec::with_capacity(parts.len());
    for part in parts {
        let cidr: IpNet = part
            .parse()
            .map_err(|_| ValueError::NotACidr(part.to_owned()))?;
        if cidr.trunc() != cidr {
            return Err(ValueError::HostBits {
                text: part.to_owned(),
                network: cidr.trunc(),
            });
        }
        cidrs.push(cidr);
    }
    reconcilers::service_range::validate_ranges(&cidrs)
        .map_err(|problem| ValueError::Ranges(problem.to_string()))?;
    Ok(cidrs)
}

/// `a,b`, as the flag takes it.
pub fn format_cidrs(cidrs: &[IpNet]) -> String {
    cidrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

pub(super) fn ser_cidrs<S: serde::Serializer>(
    cidrs: &[IpNet],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format_cidrs(cidrs))
}
