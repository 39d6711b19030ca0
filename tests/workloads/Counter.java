// A JVM job (issue 29): counts in its memory, one `count N` a tick. The JVM keeps
// /tmp/hsperfdata_<user>/<pid> mapped for as long as it runs: a checkpoint that does not carry
// that node-local file does not restore on another node.
public class Counter {
    public static void main(String[] args) throws InterruptedException {
        long interval = (long) (Double.parseDouble(args[0]) * 1000);
        System.out.println("ready");
        for (long n = 1; ; n++) {
            System.out.println("count " + n);
            Thread.sleep(interval);
        }
    }
}
