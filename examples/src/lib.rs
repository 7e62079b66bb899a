//! Examples.
