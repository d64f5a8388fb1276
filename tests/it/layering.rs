//! The crate map holds: every `crate::` path in `src/` (comments and test modules left out) goes
//! from a module to one of a lower layer, as the layer table in `src/lib.rs` states, and never
//! along an edge the table's "Never" line names. The table is read from `lib.rs` itself, so the
//! map a newcomer reads is the map this test enforces.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level modules by layer, and the forbidden edges, as `src/lib.rs` states them.
struct Map {
    layer: BTreeMap<String, usize>,
    never: BTreeSet<(String, String)>,
}

/// Names in backticks on a line: "`a`, `b`" gives a, b.
fn ticked(line: &str) -> Vec<String> {
    line.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

fn read_map(lib: &str) -> Map {
    let mut layer = BTreeMap::new();
    let mut never = BTreeSet::new();
    let mut in_never = false;
    for line in lib.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            continue;
        };
        let doc = doc.trim();
        // `| 3 | `a`, `b` |`
        if let Some(row) = doc.strip_prefix('|') {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            if let Some(n) = cells.first().and_then(|c| c.parse::<usize>().ok()) {
                for m in ticked(cells[1]) {
                    assert!(
                        layer.insert(m.clone(), n).is_none(),
                        "`{m}` is in two layers of lib.rs's table"
                    );
                }
            }
            continue;
        }
        if doc.starts_with("Never, whatever the layers:") {
            in_never = true;
        }
        if in_never {
            if doc.is_empty() {
                in_never = false;
                continue;
            }
            for pair in doc.split(';') {
                if let Some((from, to)) = pair.split_once("->") {
                    let (from, to) = (ticked(from), ticked(to));
                    assert_eq!((from.len(), to.len()), (1, 1), "a Never edge: {pair}");
                    never.insert((from[0].clone(), to[0].clone()));
                }
            }
        }
    }
    Map { layer, never }
}

/// The top-level modules `lib.rs` declares.
fn declared(lib: &str) -> BTreeSet<String> {
    lib.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix("pub mod ")
                .or_else(|| l.strip_prefix("pub(crate) mod "))
                .or_else(|| l.strip_prefix("mod "))?;
            Some(rest.trim_end_matches(';').to_string())
        })
        .collect()
}

/// Source text with comments, string and char literals and `#[cfg(test)]` items removed.
fn code_of(text: &str) -> String {
    drop_test_items(&strip_literals(text))
}

/// Source text without comments, string literals and char literals.
fn strip_literals(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |e| e + 2);
        } else if let Some(raw) = rest.strip_prefix("r#\"") {
            i += 3 + raw.find("\"#").map_or(raw.len(), |e| e + 2);
        } else if rest.starts_with('"') {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if let Some(escaped) = rest.strip_prefix("'\\") {
            // '\n', '\'', '\u{..}'
            i += 2 + escaped.find('\'').map_or(rest.len(), |e| e + 1);
            if escaped.starts_with('\'') {
                i += 1;
            }
        } else if rest.starts_with('\'') && rest.chars().nth(2) == Some('\'') {
            // 'x' (a lifetime has no closing quote)
            i += 1 + rest[1..].chars().next().unwrap().len_utf8() + 1;
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Code without the items marked `#[cfg(test)]` (each up to its end at brace depth zero).
fn drop_test_items(code: &str) -> String {
    const MARK: &str = "#[cfg(test)]";
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find(MARK) {
        out.push_str(&rest[..at]);
        let item = &rest[at + MARK.len()..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (k, c) in item.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The top-level modules a piece of code names through `crate::`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `$crate::`, `mycrate::`
        }
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a::{b, c}, d}`: the names at the group's own depth.
            let mut depth = 1;
            let mut expect = true;
            let mut k = 0;
            let chars: Vec<char> = group.chars().collect();
            while k < chars.len() && depth > 0 {
                let c = chars[k];
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 1 => expect = true,
                    c if c.is_whitespace() => {}
                    _ => {
                        if depth == 1 && expect {
                            let word: String = chars[k..]
                                .iter()
                                .take_while(|c| c.is_alphanumeric() || **c == '_')
                                .collect();
                            if !word.is_empty() {
                                names.insert(word.clone());
                                k += word.chars().count();
                                expect = false;
                                continue;
                            }
                        }
                        expect = false;
                    }
                }
                k += 1;
            }
        } else {
            names.insert(ident(rest));
        }
    }
    names
}

/// Every edge between top-level modules: (from, to) with the files that make it.
fn edges(src: &Path, modules: &BTreeSet<String>) -> BTreeMap<(String, String), Vec<String>> {
    let mut out: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap();
            let first = rel.components().next().unwrap().as_os_str();
            let from = first.to_string_lossy().trim_end_matches(".rs").to_string();
            if from == "lib" || from == "main" {
                continue;
            }
            let code = code_of(&std::fs::read_to_string(&path).unwrap());
            for to in crate_paths(&code) {
                if to != from && modules.contains(&to) {
                    out.entry((from.clone(), to))
                        .or_default()
                        .push(rel.display().to_string());
                }
            }
        }
    }
    out
}

fn violations(map: &Map, edges: &BTreeMap<(String, String), Vec<String>>) -> Vec<String> {
    let mut bad = Vec::new();
    for ((from, to), files) in edges {
        let (lf, lt) = (map.layer[from], map.layer[to]);
        if lt >= lf {
            bad.push(format!(
                "{from} (layer {lf}) -> {to} (layer {lt}): not downward, in {files:?}"
            ));
        }
        if map.never.contains(&(from.clone(), to.clone())) {
            bad.push(format!("{from} -> {to}: never allowed, in {files:?}"));
        }
    }
    bad
}

#[test]
fn every_import_goes_down_the_layers_the_crate_map_states() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let map = read_map(&lib);
    let modules = declared(&lib);
    let listed: BTreeSet<String> = map.layer.keys().cloned().collect();
    assert_eq!(
        listed, modules,
        "lib.rs's layer table lists exactly the modules lib.rs declares"
    );
    assert!(!map.never.is_empty(), "the Never line was read");
    let edges = edges(&root.join("src"), &modules);
    assert!(
        edges.len() > 50,
        "the module graph was read ({} edges)",
        edges.len()
    );
    let bad = violations(&map, &edges);
    assert!(
        bad.is_empty(),
        "edges against the crate map:\n{}",
        bad.join("\n")
    );
}

/// The reader itself: paths in comments, strings and test modules do not count; grouped and
/// nested `use` lists do; an upward edge and a Never edge are reported.
#[test]
fn the_layering_check_reads_paths_as_rustc_would_and_reports_upward_edges() {
    let code = code_of(
        "use crate::{a::{b, c}, d};\n// crate::e\nlet s = \"crate::f\"; let c = '{';\n\
         fn g() { crate::h::x(); }\n#[cfg(test)]\nmod tests { use crate::i; }\nuse crate::j;\n",
    );
    let names = crate_paths(&code);
    let want: BTreeSet<String> = ["a", "d", "h", "j"].iter().map(|s| s.to_string()).collect();
    assert_eq!(names, want, "{code}");

    let lib = "//! | 0 | `low` |\n//! | 1 | `mid`, `side` |\n//! | 2 | `high` |\n//!\n\
               //! Never, whatever the layers: `high` -> `low`.\n//!\n";
    let map = read_map(lib);
    assert_eq!(map.layer["side"], 1);
    let edge = |a: &str, b: &str| ((a.to_string(), b.to_string()), vec!["f.rs".to_string()]);
    let edges: BTreeMap<_, _> = [
        edge("mid", "low"),
        edge("low", "mid"),
        edge("mid", "side"),
        edge("high", "low"),
    ]
    .into_iter()
    .collect();
    let bad = violations(&map, &edges);
    assert_eq!(bad.len(), 3, "{bad:#?}");
    assert!(bad.iter().any(|b| b.starts_with("low (layer 0) -> mid")));
    assert!(bad.iter().any(|b| b.starts_with("mid (layer 1) -> side")));
    assert!(bad.iter().any(|b| b.starts_with("high -> low: never")));
}
