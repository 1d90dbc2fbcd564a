fn main() { println!("hypoll: skeleton"); }
