//! `sagabox new NAME --lang rust|python|js [--dir D]`: writes a ready-to-build plugin project.
//!
//! The projects are the examples of `guest-tools/examples/<lang>/`, embedded in the binary
//! with the example's plugin name replaced by NAME, and the host's WIT (`wit/plugin.wit`) as
//! this binary was built with. The examples are thus what `new` writes, by construction
//! (tests/languages.rs also checks that every file of an example is embedded).

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use sagabox::runtime::valid_name;

use super::Outcome;

/// The language of the plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    Js,
}

#[derive(clap::Args)]
pub struct Args {
    /// The plugin's name (lower-case letters, digits, '_' and '-'): its tools are NAME.<tool>.
    name: String,

    /// The language to write it in.
    #[arg(long, value_enum)]
    lang: Lang,

    /// Where to write the project [default: ./NAME]; it must not exist or be empty.
    #[arg(long, value_name = "D")]
    dir: Option<PathBuf>,
}

/// The host's interface, as this binary implements it.
const WIT: &str = include_str!("../../../wit/plugin.wit");

/// `(path, text)` of an example's files, read at build time.
macro_rules! example {
    ($lang:literal: $($path:literal),+ $(,)?) => {
        &[$(($path, include_str!(concat!("../../../guest-tools/examples/", $lang, "/", $path)))),+]
    };
}

/// One project template: an example and the plugin name it uses.
pub struct Template {
    pub example: &'static str,
    pub files: &'static [(&'static str, &'static str)],
    /// What to run in the project to get `<name>.wasm`.
    pub build: &'static str,
}

const JS: Template = Template {
    example: "example_js",
    files: example!("js":
        "README.md", ".gitignore", "package.json", "package-lock.json", "src/plugin.js",
        "example_js.policy.toml", "sagas/example_js.json", "sagas/example_js.fixture.json",
        "sagas/example_js.input.json",
    ),
    build: "npm ci && npm run build",
};

const PYTHON: Template = Template {
    example: "example_py",
    files: example!("python":
        "README.md", ".gitignore", "requirements.lock", "app.py",
        "example_py.policy.toml", "sagas/example_py.json", "sagas/example_py.fixture.json",
        "sagas/example_py.input.json",
    ),
    build: "python3 -m venv .venv && .venv/bin/pip install --no-deps -r requirements.lock && \
            .venv/bin/componentize-py -d wit -w plugin componentize app -o NAME.wasm",
};

const RUST: Template = Template {
    example: "example_rust",
    files: example!("rust":
        "README.md", ".gitignore", "Cargo.toml", "src/lib.rs",
        "example_rust.policy.toml", "sagas/example_rust.json", "sagas/example_rust.fixture.json",
        "sagas/example_rust.input.json",
    ),
    build: "cargo build --release --target wasm32-wasip2 && cp target/wasm32-wasip2/release/plugin.wasm NAME.wasm",
};

impl Lang {
    pub fn template(self) -> &'static Template {
        match self {
            Lang::Js => &JS,
            Lang::Python => &PYTHON,
            Lang::Rust => &RUST,
        }
    }
}

/// The files of a project named `name` in `lang`: relative path and contents.
pub fn project(lang: Lang, name: &str) -> Vec<(String, String)> {
    let template = lang.template();
    let named = |text: &str| text.replace(template.example, name);
    let mut files: Vec<(String, String)> =
        template.files.iter().map(|(path, text)| (named(path), named(text))).collect();
    files.push(("wit/plugin.wit".into(), WIT.into()));
    files
}

pub fn run(args: Args) -> anyhow::Result<Outcome> {
    if !valid_name(&args.name) {
        bail!(
            "'{}' is not a valid plugin name (lower-case letters, digits, '_' and '-', starting with a letter or digit)",
            args.name
        );
    }
    let dir = args.dir.clone().unwrap_or_else(|| PathBuf::from(&args.name));
    check_empty(&dir)?;
    for (path, text) in project(args.lang, &args.name) {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let build = args.lang.template().build.replace("NAME", &args.name);
    println!("wrote the {:?} plugin '{}' in {}", args.lang, args.name, dir.display());
    println!("build:   cd {} && {build}", dir.display());
    println!("verify:  sagabox --plugins . verify sagas/{}.json", args.name);
    Ok(Outcome::Success)
}

/// Refuses to write into a directory that holds anything (or into a file).
fn check_empty(dir: &Path) -> anyhow::Result<()> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                bail!("{} is not empty: give `--dir` a new or empty directory", dir.display());
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot use {} for the project", dir.display())),
    }
}
