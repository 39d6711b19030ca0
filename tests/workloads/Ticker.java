// A JVM job (issue 29): counts in its memory, `count N` each tick. The JVM keeps
// /tmp/hsperfdata_<user>/<pid> mapped while it runs and removes it when it ends.
public class Ticker {
    public static void main(String[] args) throws InterruptedException {
        for (long n = 1; ; n++) {
            System.out.println("count " + n);
            Thread.sleep(100);
        }
    }
}
