//! `eagle-check engines`: the engine rule table, every engine with its versions and capture
//! paths, then the table the README shows.

use crate::engine::{Engine, markdown_table};

/// The listing (`markdown`: the README's table alone).
pub fn listing(markdown: bool) -> String {
    if markdown {
        return markdown_table();
    }
    let mut out = String::new();
    for engine in Engine::ALL {
        let versions: Vec<String> = engine.versions().iter().map(|v| v.to_string()).collect();
        let paths: Vec<&str> = engine
            .paths()
            .into_iter()
            .filter(|p| !p.is_empty())
            .collect();
        out.push_str(&format!(
            "{engine}: versions {}{}\n",
            versions.join(", "),
            if paths.is_empty() {
                String::new()
            } else {
                format!("; paths {}", paths.join(", "))
            }
        ));
    }
    out.push_str(&format!("\n{}\n", markdown_table()));
    out
}
