// The body of each module's link check (lib/meson.build: arrows-MODULE): the
// module's whole library is linked into this program with only the modules
// docs/ARCHITECTURE.md lets it use, so a call into any other is an undefined
// symbol and the build fails. The program itself does nothing.
int main() { return 0; }
