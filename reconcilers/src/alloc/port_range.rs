//! kube-apiserver's `--service-node-port-range`, one type for every reader: the configuration
//! parses the setting into it once, the NodePort repair plans with it, and the legacy bitmap's
//! stored range is read into it.

use std::fmt;
use std::str::FromStr;

/// Ports `base` to `last`, both inclusive, within 1-65535.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    base: u16,
    last: u16,
}

/// What a refused range's message ends with.
pub const PORT_RANGE_HINT: &str = "(expected BASE-LAST with BASE <= LAST, e.g. 30000-32767)";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortRangeError {
    #[error("{0:?} is not a port range {PORT_RANGE_HINT}")]
    NotARange(String),
    #[error("{text:?} is inverted: {base} is above {last} {PORT_RANGE_HINT}")]
    Inverted { text: String, base: u16, last: u16 },
    #[error("{0:?} is not a port range of ports 1-65535 {PORT_RANGE_HINT}")]
    OutOfRange(String),
}

impl PortRange {
    pub fn new(base: u16, last: u16) -> Result<Self, PortRangeError> {
        let text = || format!("{base}-{last}");
        if base == 0 {
            return Err(PortRangeError::OutOfRange(text()));
        }
        if base > last {
            return Err(PortRangeError::Inverted {
                text: text(),
                base,
                last,
            });
        }
        Ok(Self { base, last })
    }

    /// Every form kube-apiserver takes (`utilnet.PortRange.Set`): `BASE-LAST`, `BASE+OFFSET` or
    /// one port, as its flag is written in a manifest and as it stores the bitmap's range.
    pub fn parse_any_form(text: &str) -> Result<Self, PortRangeError> {
        let trimmed = text.trim();
        let port = |part: &str| part.trim().parse::<u16>().ok();
        let (base, last) = if let Some((base, last)) = trimmed.split_once('-') {
            (port(base), port(last))
        } else if let Some((base, offset)) = trimmed.split_once('+') {
            let base = port(base);
            (base, base.and_then(|base| base.checked_add(port(offset)?)))
        } else {
            (port(trimmed), port(trimmed))
        };
        match (base, last) {
            (Some(base), Some(last)) => Self::new(base, last).map_err(|err| err.about(text)),
            _ if trimmed.contains(['-', '+']) || trimmed.parse::<u64>().is_ok() => {
                Err(PortRangeError::OutOfRange(text.to_owned()))
            }
            _ => Err(PortRangeError::NotARange(text.to_owned())),
        }
    }

    pub fn base(&self) -> u16 {
        self.base
    }

    pub fn last(&self) -> u16 {
        self.last
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.base..=self.last).contains(&port)
    }

    /// Number of ports in the range.
    pub fn size(&self) -> usize {
        usize::from(self.last - self.base) + 1
    }

    /// The port's place in the range, if it lies inside.
    pub fn offset(&self, port: i32) -> Option<usize> {
        let port = u16::try_from(port).ok()?;
        self.contains(port).then(|| usize::from(port - self.base))
    }
}

impl PortRangeError {
    /// The same refusal, quoting the text as it was written.
    fn about(self, text: &str) -> Self {
        match self {
            Self::NotARange(_) => Self::NotARange(text.to_owned()),
            Self::OutOfRange(_) => Self::OutOfRange(text.to_owned()),
            Self::Inverted { base, last, .. } => Self::Inverted {
                text: text.to_owned(),
                base,
                last,
            },
        }
    }
}

/// `BASE-LAST`, the form the configuration documents.
impl FromStr for PortRange {
    type Err = PortRangeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if !text.contains('-') {
            return Err(PortRangeError::NotARange(text.to_owned()));
        }
        Self::parse_any_form(text)
    }
}

impl Default for PortRange {
    /// kube-apiserver's default.
    fn default() -> Self {
        Self {
            base: 30000,
            last: 32767,
        }
    }
}

/// As upstream's `net.PortRange.String()`, which the events quote.
impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.base, self.last)
    }
}

impl serde::Serialize for PortRange {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_takes_base_dash_last() {
        let range: PortRange = "30000-32767".parse().unwrap();
        assert_eq!(range, PortRange::default());
        assert_eq!(" 30000 - 30000 ".parse::<PortRange>().unwrap().size(), 1);
        assert_eq!(
            "30000".parse::<PortRange>(),
            Err(PortRangeError::NotARange("30000".to_owned()))
        );
        assert_eq!(
            "0-10".parse::<PortRange>(),
            Err(PortRangeError::OutOfRange("0-10".to_owned()))
        );
        assert_eq!(
            "30000-70000".parse::<PortRange>(),
            Err(PortRangeError::OutOfRange("30000-70000".to_owned()))
        );
        assert_eq!(
            "2-1".parse::<PortRange>().unwrap_err().to_string(),
            "\"2-1\" is inverted: 2 is above 1 (expected BASE-LAST with BASE <= LAST, e.g. \
             30000-32767)"
        );
        assert!(matches!(
            "a-b".parse::<PortRange>(),
            Err(PortRangeError::OutOfRange(_))
        ));
    }

    #[test]
    fn kube_apiservers_forms_are_read_as_it_reads_them() {
        let parse = |text| PortRange::parse_any_form(text).map(|r| (r.base(), r.last()));
        assert_eq!(parse("30000-32767"), Ok((30000, 32767)));
        assert_eq!(parse("30000+2767"), Ok((30000, 32767)));
        assert_eq!(parse("30000"), Ok((30000, 30000)));
        assert!(parse("32767-30000").is_err());
        assert!(parse("10.0.0.0/24").is_err());
        assert!(parse("").is_err());
        assert!(parse("65535+1").is_err());
    }

    #[test]
    fn offsets_count_from_the_base() {
        let range = PortRange::new(1, 65535).unwrap();
        assert_eq!(range.size(), 65535);
        assert_eq!(range.offset(0), None);
        assert_eq!(range.offset(65535), Some(65534));
        assert_eq!(range.offset(65536), None);
        assert!(PortRange::new(32767, 30000).is_err());
        assert_eq!(PortRange::default().to_string(), "30000-32767");
    }
}
