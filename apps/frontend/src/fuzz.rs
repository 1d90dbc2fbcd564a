//! The mutations the front ends' fuzz tests apply to the seeds of their corpora (real
//! conversations, checked in beside each protocol): flipped bits, inserted and deleted
//! bytes, a field overwritten with a value on one of the protocol's boundaries, and a seed
//! spliced onto another. Each protocol says what its boundaries are and how it writes a
//! 32-bit field ([`Grammar`]); the rest is the same for every byte-stream protocol. Built
//! only with the `fuzz` feature, for tests.

use proptest::prelude::*;

/// One change to a seed. Positions are taken modulo the seed's length as it is then, so
/// any value applies to any seed.
#[derive(Clone, Debug)]
pub enum Mutation {
    Flip {
        at: usize,
        bit: u8,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Delete {
        at: usize,
        len: usize,
    },
    /// Overwrites 4 bytes with a value that sits on a boundary of the protocol.
    Boundary {
        at: usize,
        value: u32,
    },
    /// Appends (part of) another seed.
    Splice {
        seed: usize,
        from: usize,
    },
}

/// What a protocol's mutations are made of.
#[derive(Clone, Debug)]
pub struct Grammar {
    /// Values on the protocol's boundaries (sizes, limits, magic numbers); arbitrary values
    /// are drawn besides them.
    pub boundaries: &'static [u32],
    /// Whether the protocol writes its fields big-endian (NBD) or little-endian (NVMe).
    pub big_endian: bool,
    /// The longest run of bytes one deletion removes.
    pub delete_bytes_max: usize,
    /// A mutated stream is cut to this length, so a case stays quick.
    pub stream_bytes_max: usize,
}

impl Grammar {
    /// Draws one mutation: each kind alike, a boundary value most of the time where a field
    /// is overwritten.
    pub fn mutation(&self) -> impl Strategy<Value = Mutation> {
        let listed = u32::try_from(self.boundaries.len()).unwrap_or(u32::MAX);
        let boundary = prop_oneof![
            listed => prop::sample::select(self.boundaries),
            1 => any::<u32>(),
        ];
        prop_oneof![
            (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
            (any::<usize>(), prop::collection::vec(any::<u8>(), 1..64))
                .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
            (any::<usize>(), 1..self.delete_bytes_max.max(2))
                .prop_map(|(at, len)| Mutation::Delete { at, len }),
            (any::<usize>(), boundary).prop_map(|(at, value)| Mutation::Boundary { at, value }),
            (any::<usize>(), any::<usize>())
                .prop_map(|(seed, from)| Mutation::Splice { seed, from }),
        ]
    }

    /// Seed `seed` of `seeds` (taken modulo their count) with `mutations` applied in order,
    /// cut to [`Grammar::stream_bytes_max`].
    pub fn mutate(&self, seeds: &[Vec<u8>], seed: usize, mutations: &[Mutation]) -> Vec<u8> {
        assert!(!seeds.is_empty(), "a corpus to mutate");
        let mut s = seeds[seed % seeds.len()].clone();
        for m in mutations {
            match m {
                Mutation::Flip { at, bit } if !s.is_empty() => {
                    let i = at % s.len();
                    s[i] ^= 1 << (bit % 8);
                }
                Mutation::Insert { at, bytes } => {
                    let i = at % (s.len() + 1);
                    s.splice(i..i, bytes.iter().copied());
                }
                Mutation::Delete { at, len } if !s.is_empty() => {
                    let i = at % s.len();
                    let end = i.saturating_add(*len).min(s.len());
                    s.drain(i..end);
                }
                Mutation::Boundary { at, value } if s.len() >= 4 => {
                    let i = at % (s.len() - 3);
                    let bytes = if self.big_endian {
                        value.to_be_bytes()
                    } else {
                        value.to_le_bytes()
                    };
                    s[i..i + 4].copy_from_slice(&bytes);
                }
                Mutation::Splice { seed, from } => {
                    let other = &seeds[seed % seeds.len()];
                    if !other.is_empty() {
                        s.extend_from_slice(&other[from % other.len()..]);
                    }
                }
                // A flip, deletion or overwrite of a seed too short for it: nothing to do.
                _ => {}
            }
        }
        s.truncate(self.stream_bytes_max);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRAMMAR: Grammar = Grammar {
        boundaries: &[0x0102_0304],
        big_endian: true,
        delete_bytes_max: 8,
        stream_bytes_max: 16,
    };

    #[test]
    fn each_mutation_changes_the_seed_as_it_says() {
        let seeds = vec![vec![0u8; 8], vec![9, 9]];
        let m = |ms: &[Mutation]| GRAMMAR.mutate(&seeds, 0, ms);
        assert_eq!(m(&[Mutation::Flip { at: 9, bit: 1 }])[1], 2);
        assert_eq!(
            m(&[Mutation::Insert {
                at: 0,
                bytes: vec![7]
            }])
            .len(),
            9
        );
        assert_eq!(m(&[Mutation::Delete { at: 6, len: 5 }]).len(), 6);
        let b = m(&[Mutation::Boundary {
            at: 0,
            value: 0x0102_0304,
        }]);
        assert_eq!(&b[..4], &[1, 2, 3, 4]);
        let little = Grammar {
            big_endian: false,
            ..GRAMMAR
        };
        let l = little.mutate(
            &seeds,
            0,
            &[Mutation::Boundary {
                at: 0,
                value: 0x0102_0304,
            }],
        );
        assert_eq!(&l[..4], &[4, 3, 2, 1]);
        assert_eq!(
            m(&[Mutation::Splice { seed: 1, from: 1 }]),
            [&[0u8; 8][..], &[9]].concat()
        );
        // Cut to the bound, and seeds too short for a change are left as they are.
        let long = m(&[Mutation::Insert {
            at: 0,
            bytes: vec![1; 20],
        }]);
        assert_eq!(long.len(), GRAMMAR.stream_bytes_max);
        let short = vec![vec![]];
        assert!(GRAMMAR
            .mutate(&short, 0, &[Mutation::Flip { at: 0, bit: 0 }])
            .is_empty());
    }
}
