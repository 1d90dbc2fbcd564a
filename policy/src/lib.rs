//! Completion statistics and the pluggable poll policies of hypoll (see issue 4).
