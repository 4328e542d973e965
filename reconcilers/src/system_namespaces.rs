//! System namespaces loop.
