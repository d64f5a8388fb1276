//! Enumerated settings, each defined once: every value with the one name that the database's
//! CHECK constraint, the command line, the error texts and the documentation use, and a line of
//! help. A test holds the database's CHECK lists to these definitions
//! (`tests/it/manage.rs`, `every_enumerated_setting_matches_its_check_constraint`).

/// An enumerated setting (defined with [`named!`]).
pub trait Named: Sized + Copy + PartialEq + 'static {
    /// What the setting is called (its column or key), for messages.
    const SETTING: &'static str;
    /// Every value with its name and a line of help, in the order help texts list them.
    const VALUES: &'static [(Self, &'static str, &'static str)];

    /// The value's name.
    fn as_str(self) -> &'static str {
        Self::VALUES
            .iter()
            .find(|(v, _, _)| *v == self)
            .map(|(_, name, _)| *name)
            .expect("every value is listed")
    }

    /// The value named `name`.
    fn parse(name: &str) -> Option<Self> {
        Self::VALUES
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(v, _, _)| *v)
    }

    /// Every name, in order.
    fn names() -> Vec<&'static str> {
        Self::VALUES.iter().map(|(_, n, _)| *n).collect()
    }

    /// "a, b or c": the names as a sentence lists them.
    fn listed() -> String {
        let names = Self::names();
        match names.split_last() {
            Some((last, [])) => last.to_string(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        }
    }

    /// Help for the command line: every value with its help, from this definition.
    fn help() -> String {
        let values: Vec<String> = Self::VALUES
            .iter()
            .map(|(_, name, help)| format!("`{name}`: {help}"))
            .collect();
        format!("One of {}.", values.join("; "))
    }

    /// The refusal of a name that is none of the values, naming the setting.
    fn refusal(name: &str) -> String {
        format!(
            "{}: {name:?} is not one of {}",
            Self::SETTING,
            Self::listed()
        )
    }
}

/// Defines an enumerated setting: the enum, its [`Named`] table, `FromStr` (the error is
/// [`Named::refusal`]) and `Display` (the name).
macro_rules! named {
    (
        $(#[$meta:meta])*
        $vis:vis enum $T:ident as $setting:literal {
            $( $(#[$vmeta:meta])* $V:ident = $name:literal : $help:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $T {
            $( $(#[$vmeta])* $V ),+
        }

        impl $crate::model::named::Named for $T {
            const SETTING: &'static str = $setting;
            const VALUES: &'static [(Self, &'static str, &'static str)] =
                &[ $( ($T::$V, $name, $help) ),+ ];
        }

        impl $T {
            /// The value's name (as the database, the command line and the docs write it).
            #[allow(dead_code, unreachable_pub)]
            pub fn as_str(self) -> &'static str {
                <$T as $crate::model::named::Named>::as_str(self)
            }

            /// The value named `name`.
            #[allow(dead_code, unreachable_pub)]
            pub fn parse(name: &str) -> Option<Self> {
                <$T as $crate::model::named::Named>::parse(name)
            }
        }

        impl std::str::FromStr for $T {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                <$T as $crate::model::named::Named>::parse(s)
                    .ok_or_else(|| <$T as $crate::model::named::Named>::refusal(s))
            }
        }

        impl std::fmt::Display for $T {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str($crate::model::named::Named::as_str(*self))
            }
        }
    };
}
pub(crate) use named;

#[cfg(test)]
mod tests {
    use super::*;

    named! {
        /// A setting for the test.
        enum Colour as "colour" {
            Red = "red": "the first",
            Green = "green": "the second",
            Blue = "blue": "the third",
        }
    }

    #[test]
    fn names_parse_list_and_refuse_naming_the_setting() {
        assert_eq!(Colour::Green.as_str(), "green");
        assert_eq!(Colour::parse("blue"), Some(Colour::Blue));
        assert_eq!("red".parse::<Colour>(), Ok(Colour::Red));
        assert_eq!(Colour::listed(), "red, green or blue");
        assert_eq!(
            "pink".parse::<Colour>(),
            Err("colour: \"pink\" is not one of red, green or blue".to_string())
        );
        assert_eq!(Colour::Blue.to_string(), "blue");
        assert_eq!(
            Colour::help(),
            "One of `red`: the first; `green`: the second; `blue`: the third."
        );
    }
}
